"""Several nodes that keep survivors (``sdp train --on-worker-loss continue --nnodes M``): each node's share
of the ranks, the flags' checks, and node 0's launcher counting a node lost when its beat stops, never
one that has not started or has finished. The launch itself: tests/distributed/test_multinode_survivors.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from sdp_train.cli import build_parser
from sdp_train.cli.train import config_from_args, node_of
from sdp_train.errors import ConfigError
from sdp_train.trainer.agreement import MEMBERS_KEY, exited_key
from sdp_train.trainer.survivor_launcher import (NODE_LOST, Node, _join_store, _Nodes, beat_key, done_key,
                                                launch_keeping_survivors)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_each_node_starts_an_equal_share_of_the_ranks_in_node_order():
    assert [list(Node(3, n).ranks(6)) for n in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert list(Node().ranks(4)) == [0, 1, 2, 3]


def _node(*flags: str) -> Node:
    args = build_parser().parse_args(["train", "--model", "llama-debug", "--mode", "bsdp", "--active", "1.0",
                                      "--out", "unused", *flags])
    return node_of(args, config_from_args(args))


@pytest.mark.parametrize("flags, message", [
    (("--workers", "4", "--nnodes", "2"), "--nnodes 2 starts the launchers that keep survivors"),
    (("--workers", "3", "--nnodes", "2", "--on-worker-loss", "continue"), "--workers 3 must be a multiple of --nnodes 2"),
    (("--workers", "4", "--nnodes", "2", "--node-rank", "2", "--on-worker-loss", "continue"),
     "--node-rank 2 must lie in [0, --nnodes) = [0, 2)"),
    (("--workers", "4", "--nnodes", "0"), "--nnodes 0 must be >= 1"),
    (("--workers", "4", "--master-port", "70000"), "--master-port 70000 must be a port number"),
])
def test_bad_node_flags_are_refused_in_one_line_naming_the_flag(flags, message):
    with pytest.raises(ConfigError) as info:
        _node(*flags)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_node_timeout_is_refused_before_launch_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("SDP_NODE_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match=f"SDP_NODE_TIMEOUT_S='{value}' must be a positive number of seconds"):
        _node("--workers", "4", "--nnodes", "2", "--on-worker-loss", "continue")


def test_a_node_that_cannot_reach_node_0s_store_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SDP_COLLECTIVE_TIMEOUT_S", "1")
    from tests.distributed.conftest import free_port

    port = free_port()  # nothing listens there
    assert launch_keeping_survivors(["train"], 2, node=Node(2, 1, "127.0.0.1", port)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sdp: node 1: cannot reach node 0's store at 127.0.0.1:{port} (--master-addr, --master-port)")
    assert "\n" not in err


def test_the_node_flags_give_this_launchers_place():
    node = _node("--workers", "4", "--nnodes", "2", "--node-rank", "1", "--on-worker-loss", "continue",
                 "--master-addr", "10.0.0.1", "--master-port", "1234")
    assert node == Node(2, 1, "10.0.0.1", 1234)
    assert _node("--workers", "2") == Node()


def test_node_0_counts_a_silent_node_lost_but_not_one_that_never_beat_or_is_done(store, monkeypatch):
    monkeypatch.setenv("SDP_NODE_TIMEOUT_S", "0.3")
    watch = _Nodes(store, Node(4, 0), 4)  # one rank per node
    other = [_Nodes(store, Node(4, n), 4) for n in (1, 2)]
    for node in other:
        node()  # nodes 1 and 2 beat once; node 3 never starts
    store.set(done_key(2), "1")  # node 2 read the outcome and left
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        watch()
        time.sleep(0.05)
    assert store.get(exited_key(1)).decode() == NODE_LOST  # silent since its one beat
    assert not store.check([exited_key(2)]) and not store.check([exited_key(3)])
    assert watch.lost == {1}


def test_a_node_waits_for_every_members_mark_and_node_0_for_the_other_nodes(store):
    node0, node1 = _Nodes(store, Node(2, 0), 2), _Nodes(store, Node(2, 1), 2)
    store.set(MEMBERS_KEY, "0,1")
    ended: dict[int, dict] = {}
    read: dict[int, bool] = {}

    def launcher(n: int, w: _Nodes) -> None:
        ended[n] = w.run_ended({n: 0})
        read[n] = store.check([done_key(1)])  # what the outcome reads comes before node 1's done
        w.done()

    threads = [threading.Thread(target=launcher, args=(n, w)) for n, w in ((0, node0), (1, node1))]
    store.set(exited_key(0), "0")
    threads[0].start()
    time.sleep(0.3)
    assert not ended  # rank 1 has no mark yet: node 0 waits
    threads[1].start()
    time.sleep(0.3)
    assert not ended and store.add(beat_key(1), 0) > 0  # node 1 waits too, beating
    store.set(exited_key(1), "0")
    threads[1].join(timeout=10)
    assert ended[1] == {0: 0, 1: 0} and read[1] is False and store.check([done_key(1)])
    threads[0].join(timeout=10)
    assert ended[0] == {0: 0, 1: 0}


def test_a_node_reads_the_outcome_before_it_says_it_is_done(store):
    """The store's host (node 0's launcher, `sdp store`) may end as soon as every other node said it is
    done; a node that read the outcome after that lost the store (seen: `sdp store`'s launch of node 2
    ended with exit 1, `Failed to recv`, in a suite run)."""
    node1 = _Nodes(store, Node(2, 1), 2)
    for rank in (0, 1):
        store.set(exited_key(rank), "0")
    assert node1.run_ended({1: 0}) == {0: 0, 1: 0}
    assert not store.check([done_key(1)])
    node1.done()
    assert store.check([done_key(1)])


@pytest.mark.parametrize("flags, message", [
    (("--store", "10.0.0.1"), "--store '10.0.0.1' must be HOST:PORT with a port in [1, 65535]"),
    (("--store", "10.0.0.1:0"), "--store '10.0.0.1:0' must be HOST:PORT"),
    (("--store", "h:٣"), "must be HOST:PORT"),
    (("--store", "h:1234", "--master-port", "1234"),
     "--store h:1234 is the store's address: --master-port name node 0's store"),
    (("--store", "h:1234", "--on-worker-loss", "stop"), "--store h:1234 starts the launchers that keep survivors"),
])
def test_a_bad_store_address_or_flags_beside_it_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError) as info:
        _node("--workers", "4", "--nnodes", "2", "--on-worker-loss", "continue", *flags)  # the last value counts
    assert message in str(info.value) and "\n" not in str(info.value)


def test_store_gives_an_external_store_to_every_node_node_0_included():
    node = _node("--workers", "4", "--nnodes", "2", "--node-rank", "0", "--on-worker-loss", "continue",
                 "--store", "[::1]:1234")
    assert node == Node(2, 0, "::1", 1234, external=True) and not node.hosts_store
    assert _node("--workers", "4", "--nnodes", "2", "--on-worker-loss", "continue").hosts_store


def test_the_store_process_counts_node_0_lost_as_any_other(store, monkeypatch):
    monkeypatch.setenv("SDP_NODE_TIMEOUT_S", "0.3")
    watch = _Nodes(store, Node(2, 0, external=True), 2, watcher=True)
    nodes = [_Nodes(store, Node(2, n, external=True), 2) for n in (0, 1)]
    for node in nodes:
        node()  # both nodes beat once, node 0 too (it hosts nothing); then node 0 goes silent
    deadline = time.monotonic() + 0.8
    while time.monotonic() < deadline:
        watch()
        nodes[1]()
        time.sleep(0.05)
    assert store.get(exited_key(0)).decode() == NODE_LOST and not store.check([exited_key(1)])
    assert watch.lost == {0}


def _serving(nodes: int) -> tuple[threading.Thread, dict, dist.TCPStore]:
    """`serve_store` in a thread, and a client of its store."""
    from sdp_train.trainer.survivor_launcher import serve_store

    ended, ports = {}, []
    thread = threading.Thread(target=lambda: ended.__setitem__("code", serve_store(nodes, 0, ready=ports.append)),
                              daemon=True)
    thread.start()
    while not ports:
        time.sleep(0.01)
    return thread, ended, dist.TCPStore("127.0.0.1", ports[0], is_master=False, timeout=timedelta(seconds=10))


def test_the_store_process_ends_with_the_runs_outcome_once_every_node_has_read_it(capsys):
    thread, ended, client = _serving(2)
    launchers = [_Nodes(client, Node(2, n, external=True), 2) for n in (0, 1)]
    assert _join_store(client, Node(2, 0, external=True), 2) is None
    assert _join_store(client, Node(2, 1, external=True), 2) is None
    client.set(exited_key(0), "0")
    client.set(exited_key(1), "1")
    assert [w.run_ended({n: [0, 1][n]}) for n, w in enumerate(launchers)] == [{0: 0, 1: 1}] * 2
    assert ended == {}  # the store's process waits until the nodes are done
    for w in launchers:
        w.done()
    thread.join(timeout=10)
    assert ended == {"code": 1}
    assert "sdp store: the run ended: ranks 0, 1 of 2 did not all finish it" in capsys.readouterr().err


@pytest.mark.parametrize("nodes, workers, message", [
    (3, 4, "--nnodes 3 differs from the store's (2: sdp store --nnodes)"),
    (2, 6, "--workers 6 differs from the other nodes' (4): start every node with the same flags"),
])
def test_a_launcher_that_disagrees_with_the_store_is_refused_in_one_line(nodes, workers, message):
    thread, ended, client = _serving(2)
    assert _join_store(client, Node(2, 0, external=True), 4) is None  # the first sets the run's ranks
    assert _join_store(client, Node(nodes, 1, external=True), workers) == message
    for rank in range(4):  # the run ends, so that the store's thread does
        client.set(exited_key(rank), "0")
    for node in (0, 1):
        client.set(done_key(node), "1")
    thread.join(timeout=10)
    assert ended == {"code": 0}


def test_sdp_store_refuses_bad_flags_in_one_line(capsys):
    from sdp_train.cli import main

    assert main(["store", "--nnodes", "0"]) == 2
    assert main(["store", "--nnodes", "2", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sdp store: error: --nnodes 0 must be >= 1",
                   "sdp store: error: --port 70000 must be a port number in [0, 65535]"]


def test_a_replacement_waits_until_the_survivors_left_its_ranks_out_then_clears_their_marks(store, capsys):
    from sdp_train.trainer.survivor_launcher import _await_replacement

    node = Node(3, 2)
    store.set(exited_key(2), NODE_LOST)  # node 2 was lost; workers 0 and 1 still run
    ready: list = []
    thread = threading.Thread(target=lambda: ready.append(_await_replacement(store, node, node.ranks(3), 3, 1)))
    thread.start()
    time.sleep(0.8)
    assert not ready  # the survivors have not agreed yet
    store.set(MEMBERS_KEY, "0,1")
    thread.join(timeout=10)
    assert ready == [None] and not store.check([exited_key(2)])  # its replacement is a live worker
    assert "sdp: node 2: replacing a node of the run: its rank(s) 2 rejoin" in capsys.readouterr().err


def test_a_replacement_after_the_run_ended_says_so_and_exits_0(store, capsys):
    from sdp_train.trainer.survivor_launcher import _await_replacement

    store.set(MEMBERS_KEY, "0,1")
    for rank, code in ((0, "0"), (1, "0"), (2, NODE_LOST)):
        store.set(exited_key(rank), code)
    assert _await_replacement(store, Node(3, 2), range(2, 3), 3, 1) == 0
    assert "sdp: node 2: the run ended before its replacement could rejoin" in capsys.readouterr().err


@pytest.mark.parametrize("beating, rejoins, message", [
    (True, 2, "sdp: node 1: this node's launcher still runs in this run (its beat goes on)"),
    (False, 1, "needs --max-rejoins >= 2 (got 1)"),
])
def test_a_second_launcher_for_a_live_node_or_without_rejoins_is_refused_in_one_line(store, capsys, beating, rejoins,
                                                                                   message):
    from sdp_train.trainer.survivor_launcher import _await_replacement

    node = Node(2, 1)
    stop = threading.Event()
    live = _Nodes(store, node, 4)
    beat = threading.Thread(target=lambda: [(live(), time.sleep(0.05)) for _ in iter(stop.is_set, True)])
    if beating:
        beat.start()
    try:
        assert _await_replacement(store, node, node.ranks(4), 4, rejoins) == 2
    finally:
        stop.set()
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_the_watch_takes_back_a_lost_node_whose_replacement_beats(store, monkeypatch):
    monkeypatch.setenv("SDP_NODE_TIMEOUT_S", "0.2")
    watch, other = _Nodes(store, Node(2, 0), 2), _Nodes(store, Node(2, 1), 2)
    other()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        watch()
        time.sleep(0.05)
    assert watch.lost == {1}
    other()  # the replacement's launcher beats
    watch()
    assert watch.lost == set()


def test_the_store_process_of_a_single_node_run_ends_with_its_outcome(capsys):
    """`sdp store --nnodes 1`: its one launcher beats and says it is done as on several nodes (before:
    the store's process read no exit mark and failed at the end)."""
    thread, ended, client = _serving(1)
    launcher = _Nodes(client, Node(1, 0, external=True), 2)
    assert _join_store(client, Node(1, 0, external=True), 2) is None
    launcher()
    client.set(exited_key(0), "0")
    client.set(exited_key(1), "0")
    assert launcher.run_ended({0: 0, 1: 0}) == {0: 0, 1: 0}
    launcher.done()
    thread.join(timeout=10)
    assert ended == {"code": 0}
    assert "sdp store: the run ended: ranks 0, 1 of 2 finished it" in capsys.readouterr().err



def test_continuing_after_a_loss_is_refused_in_one_line_where_the_ranks_would_use_nccl(tmp_path, monkeypatch, capsys):
    import torch

    from sdp_train.cli import main
    from sdp_train.cli.train import refuse_survival_on_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code = main(["train", "--model", "llama-debug", "--workers", "2", "--on-worker-loss", "continue",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not (tmp_path / "run").exists()
    assert err.startswith("sdp train: error: on_worker_loss='continue' (--on-worker-loss) is built for gloo")
    assert "NCCL" in err
    refuse_survival_on_cuda(config_from_args(build_parser(["train"]).parse_args(["train", "--workers", "2"])))  # stop
