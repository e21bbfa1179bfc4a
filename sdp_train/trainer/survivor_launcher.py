"""The launcher of ``sdp train --on-worker-loss continue``, one per node: it starts its node's ranks as
plain processes with torchrun's environment, marks each of them that exits in the ranks' TCP store,
and (``--max-rejoins``) starts a replacement for one of them that the survivors have left out. Node 0's
launcher hosts the store; with ``--nnodes M`` every other node's launcher beats in it, and node 0's marks
the ranks of a node whose beat stops as exited (a lost node), so that the survivors agree without them.
With ``--store HOST:PORT`` the store is `serve_store`'s (``sdp store``), on a host that trains nothing:
every node's launcher beats, the store's process watches, and node 0 is lost as any other node. A
launcher started for a node that a launcher already started in the run replaces it, once it is lost.

torch's elastic agent would stop every rank when one fails, which is the rollback this avoids
(docs/design.md §7). Not here: what the ranks agree on and how a replacement joins
(`sdp_train.trainer.membership`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from sdp_train.errors import EXIT_USAGE
from sdp_train.parallel.dist import collective_timeout
from sdp_train.trainer.agreement import JOIN_ENV, MEMBERS_KEY, STEPS_DONE_KEY, exited_key, finished_key
from sdp_train.trainer.faults import die
from sdp_train.trainer.launch import LAUNCHER_ENV, input_error_line


NODE_TIMEOUT_ENV = "SDP_NODE_TIMEOUT_S"  # seconds without a node's beat before node 0 counts it lost (default 15)
NODE_LOST = "node lost"  # an exit mark (`exited_key`) that node 0 writes for a lost node's ranks
TEST_NODE_DIES_ENV = "SDP_TEST_NODE_DIES"  # tests only: the launcher dies when a rank of its node is killed


@dataclass(frozen=True)
class Node:
    """This launcher's place among ``nodes`` launchers (``--nnodes``, ``--node-rank``) and the store's
    address: node 0's (``--master-addr``, ``--master-port``; port 0 on one node: any free one), or, when
    `external`, that of an ``sdp store`` process no node runs (``--store HOST:PORT``)."""

    nodes: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    external: bool = False

    @property
    def hosts_store(self) -> bool:
        return self.rank == 0 and not self.external

    def ranks(self, world_size: int) -> range:
        """The global ranks this node starts: the node's share of `world_size`, in node order."""
        local = world_size // self.nodes
        return range(self.rank * local, (self.rank + 1) * local)


def launch_keeping_survivors(module_argv: Sequence[str], nproc: int, *, max_rejoins: int = 0,
                             node: Node = Node()) -> int:
    """Run ``python -m sdp_train.cli <module_argv>`` on this node's share of `nproc` ranks (all of them on
    one node), ranks that outlive each other.

    Each rank gets the environment torchrun would give it, with node 0's TCP store as the agent's
    store (``TORCHELASTIC_USE_AGENT_STORE``); when a rank's process ends, its exit code goes into the
    store (`exited_key`). With `max_rejoins`, a rank that failed is started again (up to
    `max_rejoins` times in all, per node), as a replacement that joins the run (`JOIN_ENV`,
    `Survival.join`), once the survivors have agreed on a membership without it and while one of
    them still runs; its exit mark is cleared first. Several nodes: each other node's launcher beats
    in the store while it waits; node 0's marks every rank of a node whose beat stops for
    ``SDP_NODE_TIMEOUT_S`` seconds (`NODE_LOST`), and every launcher waits until each worker of the
    last membership has an exit mark, node 0's also until the others have read it, since the store
    goes with node 0. With an external store (``node.external``, `serve_store`) every node beats and
    the store's process does node 0's part. No replacement is started once the members ran the last step
    (`STEPS_DONE_KEY`). Returns `launch_outcome`'s code (0 when every worker of the last membership
    finished its part); 2 with a rank's one-line input error; 128 + the signal's number when interrupted
    (this node's ranks are stopped).
    """
    timeout = collective_timeout()
    try:
        if node.hosts_store:
            store = dist.TCPStore(node.master_addr if node.nodes > 1 else "127.0.0.1", node.master_port,
                                  is_master=True, wait_for_workers=False, timeout=timeout)
            run_id = uuid.uuid4().hex
            store.set(RUN_ID_KEY, run_id)
        else:
            store = dist.TCPStore(node.master_addr, node.master_port, is_master=False, timeout=timeout)
            run_id = store.get(RUN_ID_KEY).decode()  # waits for node 0, or the store's process
    except dist.DistError as exc:  # a port in use, or the store not reached within the collective timeout
        what = ("host the store on port" if node.hosts_store else
                "reach the store at" if node.external else "reach node 0's store at")
        where = str(node.master_port) if node.hosts_store else f"{node.master_addr}:{node.master_port}"
        flags = "--store" if node.external else "--master-addr, --master-port"
        print(f"sdp: node {node.rank}: cannot {what} {where} ({flags}): "
              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr, flush=True)
        return 1
    if node.external:
        wrong = _join_store(store, node, nproc)
        if wrong is not None:
            print(f"sdp: node {node.rank}: {wrong}", file=sys.stderr, flush=True)
            return EXIT_USAGE
    ranks = node.ranks(nproc)
    replacing = not node.hosts_store and store.add(started_key(node.rank), 1) > 1
    if replacing:  # a launcher started this node before: this one replaces a lost node
        code = _await_replacement(store, node, ranks, nproc, max_rejoins)
        if code is not None:
            return code
        max_rejoins -= len(ranks)
    with tempfile.TemporaryDirectory(prefix="sdp-ranks-") as errors:
        def start(rank: int, joining: bool) -> subprocess.Popen:
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank - ranks.start), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(len(ranks)), "GROUP_RANK": str(node.rank),
                   "MASTER_ADDR": node.master_addr if node.nodes > 1 or node.external else "127.0.0.1",
                   "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                   "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
                   "TORCHELASTIC_ERROR_FILE": str(Path(errors) / f"rank{rank}.json"), LAUNCHER_ENV: "1"}
            if joining:
                env[JOIN_ENV] = "1"
            env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several local ranks
            return subprocess.Popen([sys.executable, "-m", "sdp_train.cli", *module_argv], env=env)

        procs = {rank: start(rank, replacing) for rank in ranks}
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        tick = _Nodes(store, node, nproc)
        try:
            codes = dict(zip(ranks, _wait_all(procs, store, lambda rank: start(rank, True), max_rejoins, tick=tick,
                                                  world_size=nproc)))
            codes = tick.run_ended(codes)
        except KeyboardInterrupt as exc:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                p.wait()
            sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
            print(f"sdp {module_argv[0]}: interrupted ({sig.name})", file=sys.stderr, flush=True)
            return 128 + int(sig)
        except dist.DistError:  # a store operation failed: node 0, and the store with it, is gone
            if node.hosts_store:
                raise
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            lost = ("lost the run's store (sdp store at --store)" if node.external else
                    "lost node 0, which hosts the run's store")
            print(f"sdp: node {node.rank}: {lost}: the run cannot go on; restart from a checkpoint (--resume)",
                  file=sys.stderr, flush=True)
            return 1
        finally:
            signal.signal(signal.SIGTERM, previous)
        refused = _refused(errors, [codes[r] for r in ranks], ranks.start)
        if refused is not None:
            tick.done()
            print(refused, file=sys.stderr, flush=True)
            return EXIT_USAGE
    code, lines = launch_outcome(store, codes, nproc)  # before `done`: the store's host may then end
    tick.done()
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return code


def launch_outcome(store: dist.Store, codes: dict[int, int | str], nproc: int) -> tuple[int, list[str]]:
    """The launch's exit code and the lines it prints, from every rank's exit code (`codes`) and the store: 0
    when every worker of the last membership (`MEMBERS_KEY`, all of them when none changed) exited 0 or
    had finished its part of the run before it ended (`finished_key`: a kill during its teardown; a note
    says so), after one line naming the lost ones; else 1, naming the failed ones."""
    members = _members(store) or list(range(nproc))
    others = [r for r in range(nproc) if r not in members]
    lost = ", ".join(_lost(r, codes[r]) for r in others)
    late = [r for r in members if codes[r] != 0 and store.check([finished_key(r)])]
    if all(codes[r] == 0 or r in late for r in members):
        lines = [f"sdp: note: {_lost(r, codes[r])} ended after it had finished its part of the run, which is "
                 "complete" for r in late]
        if others:
            lines.append(f"sdp: lost {lost}; rank{'s' * (len(members) > 1)} {', '.join(map(str, members))} finished "
                         "the run")
        return 0, lines
    failed = ", ".join(_lost(r, codes[r]) for r in members if codes[r] != 0)
    return 1, [f"sdp: worker failed: {failed}{f'; lost before: {lost}' if others else ''}"]


RUN_ID_KEY = "sdp/run_id"  # node 0's launch id, which every node's ranks take as TORCHELASTIC_RUN_ID
NODES_KEY = "sdp/nodes"  # an external store's node count (``sdp store --nnodes``)
WORLD_KEY = "sdp/world_size"  # the ranks of a run on an external store, set by its first launcher


def _join_store(store: dist.Store, node: Node, world_size: int) -> str | None:
    """What is wrong with this launcher on an ``sdp store`` (another node count, or another number of
    ranks than the launchers before it), or None; the first launcher records the run's ranks."""
    nodes = int(store.get(NODES_KEY).decode())
    if nodes != node.nodes:
        return f"--nnodes {node.nodes} differs from the store's ({nodes}: sdp store --nnodes)"
    first = store.compare_set(WORLD_KEY, "", str(world_size)).decode()
    if first != str(world_size):
        return f"--workers {world_size} differs from the other nodes' ({first}): start every node with the same flags"
    return None


def started_key(node: int) -> str:
    """The store counter of launchers started for node `node` in this run (more than one: replacements)."""
    return f"sdp/node{node}/started"


def replaces_node_0(node: Node) -> bool:
    """Whether this launcher, node 0's with an external store, replaces a node 0 that a launcher already
    started in this run (which then holds ``--out``, as the run's: not to be claimed again); False
    when the store cannot be reached within 5 s (the launch then says so)."""
    if not (node.external and node.rank == 0):
        return False
    try:
        store = dist.TCPStore(node.master_addr, node.master_port, is_master=False, timeout=timedelta(seconds=5))
    except dist.DistError:
        return False
    return store.check([started_key(0)])


REPLACED_BEAT_S = 0.5  # how long a replacement watches the node's beat for a launcher still running it


def _await_replacement(store: dist.Store, node: Node, ranks: range, world_size: int, max_rejoins: int
                       ) -> int | None:
    """A launcher for a node that another launcher already started in this run, a lost node's
    replacement: None once its ranks may rejoin (each has an exit mark, from its launcher or the
    store's host, and the survivors' membership leaves every one out), else this launcher's exit code
    after one line: 2 while the node's launcher still beats or `max_rejoins` cannot restart its ranks,
    0 when the run ended first."""
    who = f"sdp: node {node.rank}"
    span = f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)
    if len(ranks) > max_rejoins:
        print(f"{who}: a launcher already started this node in this run; a replacement restarts its rank(s) {span} "
              f"as joiners, which needs --max-rejoins >= {len(ranks)} (got {max_rejoins})", file=sys.stderr,
              flush=True)
        return EXIT_USAGE
    beat = store.add(beat_key(node.rank), 0)
    time.sleep(REPLACED_BEAT_S)  # a live launcher adds to it every 0.05 s
    if store.add(beat_key(node.rank), 0) != beat:
        print(f"{who}: this node's launcher still runs in this run (its beat goes on): start a replacement only for "
              "a lost node", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"{who}: replacing a node of the run: its rank(s) {span} rejoin once the survivors have left them out",
          file=sys.stderr, flush=True)
    while True:
        members = _members(store)
        if all(store.check([exited_key(w)]) for w in members or range(world_size)):
            print(f"{who}: the run ended before its replacement could rejoin", file=sys.stderr, flush=True)
            return 0
        if members and not set(members) & set(ranks) and all(store.check([exited_key(r)]) for r in ranks):
            for rank in ranks:
                store.delete_key(exited_key(rank))  # its replacement is a live worker
            return None
        time.sleep(0.05)


def serve_store(nodes: int, port: int, *, ready: Callable[[int], None] = lambda port: None) -> int:
    """Host the TCP store of a run whose `nodes` launchers connect with ``--store HOST:PORT``
    (``sdp store``), on a host that trains nothing, so that losing any node, node 0 included, is a lost
    set of workers. It watches every node's beat as node 0's launcher otherwise does (`_Nodes`), and
    returns once every node has read the run's outcome or is lost: 0 when every worker of the last
    membership exited 0 or had finished its part (`launch_outcome`), 1 otherwise, 128 + the signal's
    number when interrupted. `ready` gets the port (any free one for `port` 0) once the store listens."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=collective_timeout())
    store.set(RUN_ID_KEY, uuid.uuid4().hex)
    store.set(NODES_KEY, str(nodes))
    ready(store.port)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
    try:
        while not store.check([WORLD_KEY]):  # the first launcher says how many ranks the run has
            time.sleep(0.05)
        world_size = int(store.get(WORLD_KEY).decode())
        watch = _Nodes(store, Node(nodes, 0, external=True), world_size, watcher=True)
        codes = watch.run_ended({})
        watch.done()
    except KeyboardInterrupt as exc:
        sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        print(f"sdp store: interrupted ({sig.name})", file=sys.stderr, flush=True)
        return 128 + int(sig)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    members = _members(store) or list(range(world_size))
    lost = sorted(watch.lost)
    finished = launch_outcome(store, codes, world_size)[0] == 0  # a rank killed after its part counts as done
    print(f"sdp store: the run ended: ranks {', '.join(map(str, members))} of {world_size} "
          f"{'finished it' if finished else 'did not all finish it'}"
          + (f"; node(s) {', '.join(map(str, lost))} lost" if lost else ""), file=sys.stderr, flush=True)
    return 0 if finished else 1


def _lost(rank: int, code: int | str) -> str:
    return f"rank {rank} ({code})" if code == NODE_LOST else f"rank {rank} (exit code {code})"


class _Nodes:
    """What a launcher does beside its own ranks when there are several nodes or an ``sdp store`` (nothing
    on one node that hosts its store): the nodes
    that do not host the store beat (`beat_key`) every `_wait_all` round; its host (node 0's launcher, or
    `serve_store`'s process: `watcher`) watches the beats, marks a silent node's ranks `NODE_LOST`, and at
    the end waits until every live node has read the outcome (`done_key`)."""

    def __init__(self, store: dist.Store, node: Node, world_size: int, *, watcher: bool | None = None) -> None:
        self.store, self.node, self.world_size = store, node, world_size
        self.watcher = node.hosts_store if watcher is None else watcher
        self.timeout = node_timeout()
        watched = range(node.nodes) if node.external else range(1, node.nodes)
        self.seen = {n: (-1, time.monotonic()) for n in watched}  # node -> (beat, when it changed)
        self.lost: set[int] = set()

    @property
    def alone(self) -> bool:
        """One node on a store its launcher hosts: nobody to beat for or to watch."""
        return self.node.nodes == 1 and not self.node.external

    def __call__(self) -> None:
        if self.alone:
            return
        if not self.watcher:
            self.store.add(beat_key(self.node.rank), 1)
            return
        now = time.monotonic()
        for n, (beat, since) in self.seen.items():
            if self.store.check([done_key(n)]):
                continue
            current = self.store.add(beat_key(n), 0)
            if n in self.lost:
                if current != beat:  # a replacement's launcher beats (`_await_replacement`)
                    self.lost.discard(n)
                    self.seen[n] = (current, now)
                    print(f"sdp: node {n} is back (a replacement's launcher beats)", file=sys.stderr, flush=True)
                continue
            if current != beat:
                self.seen[n] = (current, now)
            elif current and now - since > self.timeout:  # a node that never beat: the rendezvous waits for it
                self.lost.add(n)
                for rank in Node(self.node.nodes, n).ranks(self.world_size):
                    if not self.store.check([exited_key(rank)]):
                        self.store.set(exited_key(rank), NODE_LOST)
                print(f"sdp: node {n} lost (no sign of its launcher for {self.timeout:g} s): its ranks are counted "
                      "lost", file=sys.stderr, flush=True)

    def run_ended(self, codes: dict[int, int]) -> dict[int, int | str]:
        """Every rank's exit code (a lost node's: `NODE_LOST`) once every worker of the last membership has
        an exit mark. Read what else the outcome needs from the store (`launch_outcome`), then call `done`."""
        if self.alone:
            return codes
        while True:
            members = _members(self.store) or range(self.world_size)
            if all(self.store.check([exited_key(w)]) for w in members):
                break
            self()
            time.sleep(0.05)
        marks = {r: self.store.get(exited_key(r)).decode() if self.store.check([exited_key(r)]) else NODE_LOST
                 for r in range(self.world_size)}
        return {r: codes[r] if r in codes else (NODE_LOST if mark == NODE_LOST else int(mark))
                for r, mark in marks.items()}

    def done(self) -> None:
        """This node has read the run's outcome (`done_key`); the store's host returns once every other node
        has, or is lost. A node must read nothing from the store after it: the host may then end."""
        if self.alone:
            return
        if not self.watcher:
            self.store.set(done_key(self.node.rank), "1")
            return
        while not all(n in self.lost or self.store.check([done_key(n)]) for n in self.seen):
            self()
            time.sleep(0.05)


def node_timeout() -> float:
    """Seconds without a node's beat before node 0 counts it lost (``SDP_NODE_TIMEOUT_S``, default 15)."""
    raw = os.environ.get(NODE_TIMEOUT_ENV, "15")
    try:
        seconds = float(raw) if raw.isascii() else float("nan")
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{NODE_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return seconds


def beat_key(node: int) -> str:
    """The store counter node `node`'s launcher adds to while it runs (nodes other than 0)."""
    return f"sdp/node{node}/beat"


def done_key(node: int) -> str:
    """The store key node `node`'s launcher sets once it has read the run's outcome (node 0 then exits)."""
    return f"sdp/node{node}/done"


def _members(store: dist.Store) -> list[int]:
    """The workers of the newest membership; [] before any change."""
    return [int(w) for w in store.get(MEMBERS_KEY).decode().split(",")] if store.check([MEMBERS_KEY]) else []


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher, handled as Ctrl-C is."""


def _raise_interrupt(signum, frame) -> None:
    raise _Terminated


def _wait_all(procs: dict[int, subprocess.Popen], store: dist.Store, replace, max_rejoins: int, *,
              tick: Callable[[], None] = lambda: None, world_size: int | None = None) -> list[int]:
    """Every rank's exit code (its last process's; where a replacement ended 0 without joining, the run ending
    first, that of the loss it replaced), in rank order, each marked in the store as soon as its
    process ends; a failed rank is replaced (``procs[rank] = replace(rank)``, at most `max_rejoins` times
    in all) once the survivors' membership leaves it out, while another worker of the run (`world_size`
    ranks on every node; None: `procs` are all of them) still runs. `tick` runs every round (`_Nodes`)."""
    workers = sorted(procs) if world_size is None else range(world_size)
    codes: dict[int, int] = {}
    lost_codes: dict[int, int] = {}  # a replaced rank's code at its (last) loss
    to_replace: set[int] = set()
    while len(codes) < len(procs) or to_replace:
        tick()
        for rank, p in procs.items():
            if rank not in codes and p.poll() is not None:
                codes[rank] = p.returncode
                if p.returncode < 0 and os.environ.get(TEST_NODE_DIES_ENV) == "1":  # tests only: a lost node
                    die()
                store.set(exited_key(rank), str(p.returncode))
                if p.returncode not in (0, EXIT_USAGE) and max_rejoins > 0:
                    to_replace.add(rank)
        for rank in sorted(to_replace):
            running = [w for w in (_members(store) or workers) if w != rank and not store.check([exited_key(w)])]
            if not running or store.check([STEPS_DONE_KEY]):  # nothing left to join
                to_replace.discard(rank)
            elif store.check([MEMBERS_KEY]) and rank not in _members(store):  # the survivors agreed on the loss
                to_replace.discard(rank)
                max_rejoins -= 1
                store.delete_key(exited_key(rank))  # its replacement is a live worker
                lost_codes[rank] = codes.pop(rank)
                print(f"sdp: rank {rank} lost (exit code {lost_codes[rank]}): starting a replacement that rejoins the "
                      f"run ({max_rejoins} more allowed)", file=sys.stderr, flush=True)
                procs[rank] = replace(rank)
        time.sleep(0.05)
    idle = [r for r, code in lost_codes.items() if codes[r] == 0]  # replacements that ended 0
    if idle:  # one outside the last membership never joined (the run ended first): its code is the loss's
        try:
            members = _members(store)
        except RuntimeError:  # another node's store, gone with the run's end: the codes as they are
            members = []
        codes |= {r: lost_codes[r] for r in idle if members and r not in members}
    return [codes[r] for r in sorted(procs)]


def _refused(errors: str, codes: Sequence[int], first: int = 0) -> str | None:
    """The one-line input error of the lowest rank (`first` + index in `codes`) that exited refusing its
    input, or None."""
    for rank, code in enumerate(codes, start=first):
        path = Path(errors) / f"rank{rank}.json"
        if code != EXIT_USAGE or not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        line = input_error_line(code, data)
        if line is not None:
            return line
    return None
