"""The SDP sync engine: average every held slice among exactly the workers that hold it.

Plan (once per mask, identical on every rank): every parameter slice a worker holds is an *atom*
(a whole tensor at block level; a set of rows/columns at neuron level); atoms with the same holder
set from a bounded range of layers (one by default, and at most `DEFAULT_BUCKET_CAP_MB` MiB, as
DDP's ``bucket_cap_mb``) form one `BucketPlan`. Buckets are ordered once, globally, by when backward finishes them
(the latest-in-forward parameter first) and that order is the order of every collective on every
rank, so collectives on overlapping holder groups can never be issued in different orders
(NCCL requires it; gloo would deadlock otherwise).

Run (every step): a post-accumulate-grad hook counts each bucket's gradients; when a bucket is
complete and every bucket before it has been launched, `kernels.pack` scales its slices by
1/c_j into one flat buffer and one asynchronous ``all_reduce`` among the holders starts, so
communication overlaps the rest of backward (as in DDP). `SyncEngine.finish` launches what is
left, waits, and `kernels.unpack` writes the averages back. Buckets held by a single worker need
no communication. Bytes are counted from the buffers actually passed to collectives, as buffer
bytes and as wire bytes under the ring model of `sdp_train.parallel.wire`.

Not here: building models (`sdp_train.models.subnet`), the optimizer and the loop (`sdp_train.trainer.train`).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import kernels
from sdp_train.errors import ConfigError
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.bucket_runs import BucketRun, bucket_run, place_buffers
from sdp_train.parallel.dist import before_new_group, collective_timeout, wait
from sdp_train.parallel.wire import ByteCount


def _check_kernels_package() -> None:
    """Refuse another module named ``kernels`` that shadows this project's, naming both."""
    if hasattr(kernels, "BucketLayout"):
        return
    from pathlib import Path

    found = getattr(kernels, "__file__", None) or ", ".join(getattr(kernels, "__path__", [])) or repr(kernels)
    expected = Path(__file__).resolve().parents[2] / "kernels" / "__init__.py"
    hint = "rename it or take its folder off sys.path (PYTHONPATH, the current directory)"
    found_in = Path(found).parent.parent if getattr(kernels, "__file__", None) else None
    if found_in is not None and any(found_in.glob("kernels-*.dist-info")):
        hint = ("it is the `kernels` distribution (Hugging Face's, required by transformers >= 5.25): "
                "`pip uninstall kernels` and use transformers < 5.25; docs/api.md")
    raise ImportError(f"`import kernels` found {found}, not this project's kernels package ({expected}), "
                      f"which sdp_train needs: a module named `kernels` comes earlier on sys.path; {hint}")


_check_kernels_package()


class CollectiveError(RuntimeError):
    """A holder-group collective failed or timed out; names the rank and the bucket."""


@dataclass(frozen=True)
class Atom:
    """One parameter, or one set of its rows/columns, held by the same workers."""

    name: str
    dim: int | None
    index: tuple[int, ...]  # full-model positions along `dim`; () for a whole tensor


@dataclass(frozen=True)
class BucketPlan:
    """Atoms with one holder set (from a bounded layer range), in buffer order."""

    holders: tuple[int, ...]
    atoms: tuple[Atom, ...]
    order_key: tuple[int, tuple[int, ...]]  # (-first parameter position, holders): launch order


DEFAULT_BUCKET_CAP_MB = 25.0
"""Largest bucket, in MiB of float32 gradients, as DDP's ``bucket_cap_mb`` default."""


def plan_buckets(held_by_rank: Sequence[Mapping[str, SliceSpec]], parameter_names: Sequence[str], *,
                 layers_per_bucket: int = 1, shapes: Mapping[str, Sequence[int]] | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> list[BucketPlan]:
    """Group every held parameter slice by holder set and layer range, in the global launch order.

    A bucket holds atoms of one holder set from at most `layers_per_bucket` consecutive layers
    (a layer is a numbered module such as ``layers.3`` or ``layer1.0``; parameters outside
    numbered modules belong to the layer before them, or to the one before the first), and at
    most `bucket_cap_mb` MiB of float32 gradients when `shapes` is given (a single atom larger
    than the cap gets a bucket of its own). Bounding buckets by layer lets the last layers'
    averages start while backward still runs through the first ones; keying them by holder set
    alone would make most buckets span every layer, complete only when backward ends.

    Parameters
    ----------
    held_by_rank : sequence of mapping
        For each rank, full-model tensor name -> the part it holds (``subnet.held_tensors``).
    parameter_names : sequence of str
        The full model's parameter names in forward (registration) order; buffers are excluded.
    layers_per_bucket : int
        Most consecutive layers one bucket spans (>= 1).
    shapes : mapping of str to shape, optional
        Full-model shapes of the parameters; needed for the size cap.
    bucket_cap_mb : float
        Size cap of a bucket in MiB (float32), used with `shapes`.
    """
    if isinstance(layers_per_bucket, bool) or not isinstance(layers_per_bucket, int) or layers_per_bucket < 1:
        raise ConfigError(f"layers_per_bucket must be an int >= 1, got {layers_per_bucket!r}")
    if not bucket_cap_mb > 0:
        raise ConfigError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    position = {name: i for i, name in enumerate(parameter_names)}
    layer = layer_of(parameter_names)
    cap = None if shapes is None else bucket_cap_mb * 2**20 / 4
    open_bucket: dict[tuple[int, ...], list] = {}  # holders -> [atoms (backward order), first layer, numel]
    buckets: list[tuple[tuple[int, ...], list[Atom]]] = []
    for name in reversed(parameter_names):  # backward order: the order gradients become ready
        specs = {r: held[name] for r, held in enumerate(held_by_rank) if name in held}
        for holders, atom in _atoms(name, specs):
            numel = 0 if shapes is None else _atom_numel(atom, shapes[name])
            current = open_bucket.get(holders)
            if (current is None or current[1] - layer[name] >= layers_per_bucket
                    or (cap is not None and current[2] and current[2] + numel > cap)):
                current = open_bucket[holders] = [[], layer[name], 0]
                buckets.append((holders, current[0]))
            current[0].append(atom)
            current[2] += numel
    plans = [
        BucketPlan(holders, tuple(reversed(atoms)), (-min(position[a.name] for a in atoms), holders))
        for holders, atoms in buckets
    ]
    # The latest-in-forward parameter gets its gradient first: launch those buckets first.
    return sorted(plans, key=lambda p: p.order_key)


def layer_of(parameter_names: Sequence[str]) -> dict[str, int]:
    """Parameter name -> index of its layer: the numbered module (``layers.3``, ``layer1.0``) it is in.

    Parameters outside numbered modules (embeddings, final norm, head) take the index of the
    last layer before them (-1 before the first).
    """
    layers: dict[str, int] = {}
    out: dict[str, int] = {}
    current = -1
    for name in parameter_names:
        parts = name.split(".")
        numbered = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
        if numbered is not None:
            current = layers.setdefault(".".join(parts[: numbered + 1]), len(layers))
        out[name] = current
    return out


def _atom_numel(atom: Atom, shape: Sequence[int]) -> int:
    numel = math.prod(shape)
    return numel if atom.dim is None else numel // shape[atom.dim] * len(atom.index)


def _atoms(name: str, specs: Mapping[int, SliceSpec]) -> list[tuple[tuple[int, ...], Atom]]:
    if all(s.is_whole for s in specs.values()):
        return [(tuple(sorted(specs)), Atom(name, None, ()))]
    dims = {s.dim for s in specs.values() if not s.is_whole}
    if len(dims) != 1:
        raise ConfigError(f"tensor {name!r} is sliced along different dimensions {sorted(dims)} on different ranks")
    dim = dims.pop()
    full_size = next(s.full_size for s in specs.values() if not s.is_whole)
    holders_of: dict[int, list[int]] = defaultdict(list)
    for r in sorted(specs):
        index = range(full_size) if specs[r].is_whole else specs[r].index
        for i in index:
            holders_of[i].append(r)
    by_holders: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i in sorted(holders_of):
        by_holders[tuple(holders_of[i])].append(i)
    return [(h, Atom(name, dim, tuple(idx))) for h, idx in by_holders.items()]


class _Bucket:
    """This rank's share of one BucketPlan: its parameters, layout, buffer and group."""

    def __init__(self, plan: BucketPlan, params: dict[str, nn.Parameter], local_index: Mapping[str, SliceSpec],
                 group: dist.ProcessGroup | None, device: torch.device, *, own_buffer: bool = True) -> None:
        self.plan = plan
        self.group = group
        self.params = [params[a.name] for a in plan.atoms]
        specs = [kernels.SegmentSpec(i, *_segment(a, local_index[a.name]), coverage=len(plan.holders))
                 for i, a in enumerate(plan.atoms)]
        self.layout = kernels.BucketLayout([p.shape for p in self.params], specs, device=device,
                                           block_size=kernels.block_size_for(device))
        # the engine's buckets are slices of its flat buffers (`bucket_runs.place_buffers`)
        self.buffer = torch.empty(self.layout.total_numel, dtype=self.params[0].dtype, device=device) if own_buffer else None
        self.flat: torch.Tensor | None = None
        self.start = 0
        self.pending = 0
        self.work: dist.Work | None = None
        self.launched = False

    @property
    def communicates(self) -> bool:
        return self.group is not None

    def grads(self) -> list[torch.Tensor]:
        for p in self.params:
            if p.grad is None:  # a parameter the forward pass did not use: its gradient is zero
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]


def _segment(atom: Atom, local: SliceSpec) -> tuple[str, tuple[int, ...]]:
    if atom.dim is None:
        return "whole", ()
    if atom.dim not in (0, 1):
        raise ConfigError(f"tensor {atom.name!r} is sliced along dim {atom.dim}; the kernels pack rows (0) or columns (1)")
    # a rank holding the whole tensor (every neuron group of the layer) packs the same positions
    return ("rows" if atom.dim == 0 else "cols"), local.local_positions(atom.index)


def unpin_default_group() -> None:
    """Keep ``torch.distributed.nn.functional`` from holding the default process group to exit.

    Its collectives' default arguments are ``group.WORLD`` as it was when the module was imported.
    torch imports it lazily (``torch._dynamo`` does, and the first meta-device operation imports
    that: a pass-through's first call probes its block on the meta device), so in a process whose
    group already exists the defaults pin that group: ``destroy_process_group`` then leaves its
    gloo threads running, the group is freed during interpreter shutdown, and a finished process
    can abort there (``terminate called without an active exception``). Imported here (while no
    group exists, its defaults are None) and, if it was imported earlier, its pinned defaults
    replaced by None, which the collectives read as the default group when they are called.
    """
    if not dist.is_available():
        return
    import inspect

    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        if inspect.isfunction(fn) and fn.__defaults__ and any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)


def holder_set_groups(holder_sets: Iterable[Sequence[int]], world_size: int, *,
                      singletons: bool) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """One process group per distinct holder set, each with the collective timeout.

    The only creator of process groups in the project, so that ``SDP_COLLECTIVE_TIMEOUT_S``
    bounds every collective. Every rank calls it with the same sets, members or not, and the
    groups are created in one sorted order, as ``dist.new_group`` requires. The complete set
    gets the world's group; a single holder gets a group of its own when `singletons` (FSDP
    needs a mesh for it), else None (the sync engine sends nothing for it). Before each ``new_group``
    every rank calls `sdp_train.parallel.dist.before_new_group` (the worker-loss recovery's watched meeting).
    """
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for holders in sorted({tuple(int(k) for k in h) for h in holder_sets}):
        if len(holders) == world_size:
            groups[holders] = dist.group.WORLD
        elif len(holders) == 1 and not singletons:
            groups[holders] = None
        else:
            before_new_group(holders)
            groups[holders] = dist.new_group(ranks=list(holders), timeout=collective_timeout())
    return groups


def create_groups(plans: Sequence[BucketPlan], world_size: int) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """The sync engine's groups: one per distinct holder set of `plans` (`holder_set_groups`),
    None for single holders."""
    return holder_set_groups((p.holders for p in plans), world_size, singletons=False)


def weak_grad_hook(owner: object) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that calls ``owner._on_grad(param)`` while `owner` exists, and does
    nothing after. Hooks live in C++, out of the garbage collector's sight: a strong one would keep
    its owner, and through it the owner's process groups and their gloo threads, alive for as long
    as the parameter, past ``destroy_process_group`` (the abort at interpreter exit)."""
    ref = weakref.ref(owner)

    def hook(param: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._on_grad(param)

    return hook


class SyncEngine:
    """Holder-set gradient averaging for one rank's (sub)model, overlapped with backward.

    Parameters
    ----------
    model : nn.Module
        This rank's model; its state-dict names are the full model's.
    plans : sequence of BucketPlan
        From `plan_buckets`, identical on every rank.
    local_index : mapping
        This rank's ``model.full_index()`` (full-model positions of its local rows/columns).
    groups : mapping
        From `create_groups`.
    rank : int
    backend : {"auto", "triton", "reference"}
        Passed to `kernels.pack` / `kernels.unpack`.
    comm_dtype : torch.dtype, optional
        dtype of the buffers sent (pack casts into it, unpack casts back); default the gradients'.
    """

    def __init__(self, model: nn.Module, plans: Sequence[BucketPlan], local_index: Mapping[str, SliceSpec],
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup | None], rank: int, *, backend: str = "auto",
                 comm_dtype: torch.dtype | None = None) -> None:
        params = dict(model.named_parameters())
        device = next(iter(params.values())).device
        self.rank = rank
        self.backend = backend
        self.buckets = [_Bucket(p, params, local_index, groups[p.holders], device,
                                own_buffer=groups[p.holders] is None)  # the others' are slices of flat buffers
                        for p in plans if rank in p.holders]
        self._of_param: dict[nn.Parameter, list[_Bucket]] = defaultdict(list)
        for bucket in self.buckets:
            for p in bucket.params:
                self._of_param[p].append(bucket)
        sending = [b for b in self.buckets if b.communicates]
        self.flat_buffers = place_buffers(sending, comm_dtype)
        # One unpack launch per flat buffer (one dtype) for every bucket, and one norm launch for the
        # single holders' buckets. This rank counts each slice it is the lowest-ranked holder of towards
        # the norm: the unpack's partials are zero for the other slices (`SegmentSpec.in_norm`).
        self._unpacks = []
        for flat in self.flat_buffers:
            members = [b for b in sending if b.flat is flat]
            self._unpacks.append(bucket_run(members, in_norm=[b.plan.holders[0] == rank for b in members]))
        alone = [b for b in self.buckets if not b.communicates and b.plan.holders[0] == rank]
        self._norm = bucket_run(alone, in_norm=[True] * len(alone)) if alone else None
        runs = [*self._unpacks, *([self._norm] if self._norm else [])]
        self._partials = torch.zeros(sum(r.layout.num_norm_partials for r in runs), dtype=torch.float32, device=device)
        self._run_partials = self._partials.split([r.layout.num_norm_partials for r in runs])
        self._packs: dict[tuple[int, int], list[BucketRun]] = {}  # per range of buckets completed together
        self._next = 0
        self.bytes = ByteCount()
        # The hooks live in C++, out of the garbage collector's sight: they hold the engine weakly,
        # so that an engine nobody references (and its process groups) is freed, not kept to exit.
        hook = weak_grad_hook(self)
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self._of_param]
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending, bucket.work, bucket.launched = len(bucket.params), None, False
        self._next = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        for bucket in self._of_param[param]:
            bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        stop = self._next
        while stop < len(self.buckets) and self.buckets[stop].pending == 0:
            stop += 1
        self._launch(stop)

    def _launch(self, stop: int) -> None:
        """Pack the buckets from the next one up to `stop` (one launch per flat buffer: the buckets that
        one gradient completed) and start their all-reduces, in the global order. A single holder's
        average is its own gradient: nothing to pack, send or unpack."""
        start = self._next
        if start == stop:
            return
        runs = self._packs.get((start, stop))
        if runs is None:  # built once per range: in a steady state backward completes the same ranges
            sending = [b for b in self.buckets[start:stop] if b.communicates]
            runs = [bucket_run(members) for flat in self.flat_buffers
                    if (members := [b for b in sending if b.flat is flat])]
            self._packs[(start, stop)] = runs
        for run in runs:
            kernels.pack(run.grads(), run.layout, run.buffer, scale=run.layout.inverse_coverage, backend=self.backend)
        for bucket in self.buckets[start:stop]:
            if bucket.communicates:
                bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)
                self.bytes.add("all_reduce", bucket.buffer.numel() * bucket.buffer.element_size(), len(bucket.plan.holders))
            bucket.launched = True
        self._next = stop

    def finish(self) -> torch.Tensor:
        """Complete this step's averaging; return this rank's share of the squared gradient norm.

        The share counts each averaged slice on exactly one rank (its lowest-ranked holder), so
        summing it over ranks gives the squared norm of the whole averaged gradient.
        """
        self._launch(len(self.buckets))
        for bucket in self.buckets:
            if bucket.work is not None:
                self._wait(bucket)
        # pack scaled by 1/c_j and the holders summed: the flat buffers hold the averages, unpacked into
        # the gradients by one launch each with this rank's share of the norm fused in; a single holder's
        # gradient is its own average, its share read in place. No host synchronisation.
        for run, partials in zip(self._unpacks, self._run_partials):
            kernels.unpack(run.buffer, run.grads(), run.layout, mode="copy", partials=partials, backend=self.backend)
        if self._norm is not None:
            kernels.squared_norm(self._norm.grads(), self._norm.layout, partials=self._run_partials[-1],
                                 backend=self.backend)
        self._reset()
        return self._partials.sum()

    def _wait(self, bucket: _Bucket) -> None:
        try:
            wait(bucket.work, bucket.params[0].device)
        except RuntimeError as exc:  # gloo/NCCL report a timed-out or broken peer this way
            names = [a.name for a in bucket.plan.atoms]
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
            raise CollectiveError(
                f"rank {self.rank}: the all_reduce of bucket {self.buckets.index(bucket)} (holders "
                f"{list(bucket.plan.holders)}, {bucket.layout.total_numel} elements: {shown}) did not "
                f"complete: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The long-lived buffers: the flat buffers, and the buffers of buckets that send nothing."""
        return [*self.flat_buffers, *(b.buffer for b in self.buckets if not b.communicates)]

    @property
    def comm_bytes(self) -> int:
        """Buffer bytes of every all_reduce this rank launched (``self.bytes.wire``: on the wire)."""
        return self.bytes.buffer

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()


class ParamBroadcaster:
    """Bb-SDP: after each step, send every block's new values from its first holder to the others.

    Every rank holds the full model (backward masking), so every rank takes part in every
    broadcast, in the global bucket order. Buckets held by all workers need none.
    """

    def __init__(self, model: nn.Module, plans: Sequence[BucketPlan], world_size: int, *, backend: str = "auto") -> None:
        params = dict(model.named_parameters())
        full = {name: SliceSpec() for name in params}
        self.backend = backend
        self.world_size = world_size
        self.bytes = ByteCount()
        self.buckets = [_Bucket(p, params, full, dist.group.WORLD, next(iter(params.values())).device)
                        for p in plans if len(p.holders) < world_size]
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @torch.no_grad()
    def broadcast(self) -> None:
        for bucket in self.buckets:
            values = [p.data for p in bucket.params]
            src = bucket.plan.holders[0]
            if self.rank == src:
                kernels.pack(values, bucket.layout, bucket.buffer, backend=self.backend)
            wait(dist.broadcast(bucket.buffer, src=src, async_op=True), bucket.buffer.device)
            self.bytes.add("broadcast", bucket.buffer.numel() * bucket.buffer.element_size(), self.world_size)
            if self.rank not in bucket.plan.holders:
                kernels.unpack(bucket.buffer, values, bucket.layout, mode="copy", backend=self.backend)

    @property
    def comm_bytes(self) -> int:
        """Buffer bytes of every broadcast so far (``self.bytes.wire``: on the wire)."""
        return self.bytes.buffer


class BufferAverager:
    """Average every floating-point buffer slice (BatchNorm running statistics) among its holders.

    Parameters are averaged through their gradients, so holders stay bit-identical; buffers are
    updated by each holder's own forward passes and would drift apart (the assembled model would
    take one holder's statistics). `average` makes every holder's copy the holders' mean, one
    ``all_reduce`` per bucket in the global plan order; `Run` calls it after every step, so
    evaluation and checkpoints see averaged statistics. Integer buffers (``num_batches_tracked``)
    are equal among holders already and are left alone.

    Parameters
    ----------
    model : nn.Module
        This rank's model.
    plans : sequence of BucketPlan
        `plan_buckets` over the model's floating-point buffer names, identical on every rank.
    local_index : mapping
        This rank's ``model.full_index()``.
    groups : mapping
        From `create_groups`, covering these plans' holder sets.
    rank : int
    """

    def __init__(self, model: nn.Module, plans: Sequence[BucketPlan], local_index: Mapping[str, SliceSpec],
                 groups: Mapping[tuple[int, ...], dist.ProcessGroup | None], rank: int, *,
                 backend: str = "auto") -> None:
        buffers = dict(model.named_buffers())
        self.backend = backend
        self.bytes = ByteCount()
        self.buckets = [_Bucket(p, buffers, local_index, groups[p.holders], next(iter(buffers.values())).device)
                        for p in plans if rank in p.holders and len(p.holders) > 1]

    @torch.no_grad()
    def average(self) -> None:
        for bucket in self.buckets:
            kernels.pack(bucket.params, bucket.layout, bucket.buffer, scale=bucket.layout.inverse_coverage,
                         backend=self.backend)
            wait(dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True), bucket.buffer.device)
            self.bytes.add("all_reduce", bucket.buffer.numel() * bucket.buffer.element_size(), len(bucket.plan.holders))
            kernels.unpack(bucket.buffer, bucket.params, bucket.layout, mode="copy", backend=self.backend)
