"""How `SubnetworkDataParallel` synchronises holders: one object per choice, chosen once.

`Stepwise` averages every gradient among its holders during backward (the `SyncEngine`'s hooks,
``no_sync``, backward masking's broadcasts), `LocalSteps` sends nothing during backward and
averages the values every H steps, `HolderFSDP` shards each block over its holders with FSDP2.
The wrapper calls the same few methods on each (docs/design.md §5, "The wrapper's parts").
Not here: the buckets and collectives themselves (`sdp_train.parallel.sync`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from masklab import Mask
from sdp_train.errors import ConfigError
from sdp_train.parallel import grads
from sdp_train.parallel.averaging import average_values
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.parts import apply_holder_fsdp
from sdp_train.parallel.sync import BucketPlan, BufferAverager, ParamBroadcaster, SyncEngine, weak_grad_hook
from sdp_train.parallel.wire import ByteCount


class Holdings:
    """What the sync of one mask works over: this worker's module and part, the buckets and the groups."""

    def __init__(self, module: nn.Module, plans: Sequence[BucketPlan], buffer_plans: Sequence[BucketPlan],
                 local_index: Mapping[str, SliceSpec], groups: Mapping, *, blocks: Sequence[str], rank: int,
                 world_size: int, device: torch.device) -> None:
        self.module, self.plans, self.buffer_plans, self.local_index = module, plans, buffer_plans, local_index
        self.groups, self.blocks, self.rank, self.world_size, self.device = groups, blocks, rank, world_size, device


class Sync:
    """The interface the wrapper uses; each subclass is one way to keep holders in agreement."""

    shared_norm = True
    """Whether the gradient norm is the averaged gradient's, one value on every rank (then torch's own
    clipping would scale holders differently: `sdp_train.parallel.clip_guard` warns)."""
    trains_schedules = True  # whether the mask may change during training
    counts_steps = False  # whether the optimizer steps must be counted (an average every H)
    singleton_groups = False  # whether one-rank holder sets get a process group
    engine: SyncEngine | None = None

    def check(self, mask: Mask) -> None:
        """Raise `ConfigError` when `mask`'s schedule cannot be trained this way."""

    def holder_sets(self, mask: Mask) -> list[tuple[int, ...]]:
        """Holder sets that need a process group beyond the buckets' own."""
        return []

    def start(self, held: Holdings, groups_with_singletons: Mapping, mask: Mask, *, values_agree: bool) -> None:
        """Begin synchronising `held` (after activation checkpointing)."""
        raise NotImplementedError

    def restart(self, held: Holdings, retired: Sequence[torch.Tensor]) -> None:
        """Synchronise under a new mask's `held`; `retired` parameters left this worker's part."""
        raise NotImplementedError

    @property
    def needs_optimizer(self) -> bool:
        """Whether something must happen after each optimizer step (`step_done`)."""
        return False

    def after_forward(self, output) -> None:
        """Called with each training forward's output."""

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients only."""
        yield

    def local_sq_norm(self, module: nn.Module, device: torch.device) -> torch.Tensor:
        """This rank's share of the squared gradient norm (by default its own gradients' norm)."""
        return grads.squared_norm(grads.grads_of(module.parameters()), device)

    def step_done(self, steps: int) -> None:
        """After optimizer step number `steps` (counted when `counts_steps`)."""

    def broadcast_held(self) -> None:
        """Send each held block's values to the workers that do not hold it (backward masking)."""

    def average(self) -> None:
        """Replace every held tensor by its holders' average (a collective)."""

    def export_values(self, state: dict[str, torch.Tensor], module: nn.Module, steps: int) -> None:
        """Put into `state` the values the full model must show (holders' averages mid-round)."""

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of this sync's collectives so far."""
        return ByteCount()

    def close(self) -> None:
        """Remove every hook, so that the sync's buffers and groups can be freed."""


class _EngineSync(Sync):
    """A sync over the `SyncEngine`'s buckets, its statistics averaged with `BufferAverager`."""

    def __init__(self) -> None:
        self.buffer_averager: BufferAverager | None = None
        self._old_bytes = ByteCount()  # of the engines and helpers that no_sync and mask changes retired
        self._average_bytes = ByteCount()  # the holder averages of parameters
        self.held: Holdings | None = None

    def _new_engine(self) -> SyncEngine:
        held = self.held
        return SyncEngine(held.module, held.plans, held.local_index, held.groups, held.rank)

    def _start_buffers(self) -> None:
        held = self.held
        self.buffer_averager = (BufferAverager(held.module, held.buffer_plans, held.local_index, held.groups,
                                               held.rank) if held.buffer_plans and held.world_size > 1 else None)

    def _retire(self) -> None:
        for retired in self._helpers():
            if retired is not None:
                self._old_bytes += retired.bytes
        self.engine.remove_hooks()

    @torch.no_grad()
    def average(self) -> None:
        if self.held.world_size == 1 or self.engine is None:
            return
        average_values(self.engine.buckets, self._average_bytes)
        if self.buffer_averager is not None:
            self.buffer_averager.average()

    def _helpers(self) -> tuple:
        return self.engine, self.buffer_averager

    @property
    def bytes(self) -> ByteCount:
        total = ByteCount()
        total += self._old_bytes
        total += self._average_bytes
        for counter in self._helpers():
            if counter is not None:
                total += counter.bytes
        return total


class Stepwise(_EngineSync):
    """Every gradient averaged among its holders during backward, complete when ``backward()`` returns;
    with `broadcast` (backward masking) the holders then send each held block's new values to the others."""

    def __init__(self, *, comm_dtype: torch.dtype | None = None, broadcast: bool = False) -> None:
        super().__init__()
        self.comm_dtype, self.broadcast = comm_dtype, broadcast
        self.broadcaster: ParamBroadcaster | None = None
        self._hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._sync_enabled = True
        self._sq_norm: torch.Tensor | None = None
        self._finish_queued = False

    def _new_engine(self) -> SyncEngine:
        held = self.held  # pack casts into the buffers' dtype, unpack casts back
        return SyncEngine(held.module, held.plans, held.local_index, held.groups, held.rank, comm_dtype=self.comm_dtype)

    def start(self, held: Holdings, groups_with_singletons: Mapping, mask: Mask, *, values_agree: bool) -> None:
        self.held = held
        self.engine = self._new_engine()
        if self.broadcast and held.world_size > 1:
            self.broadcaster = ParamBroadcaster(held.module, held.plans, held.world_size)
            if not values_agree:
                self.broadcaster.broadcast()  # non-holders' frozen copies start from the holders' values
        # running statistics (BatchNorm) move with each holder's own batches: average them too
        self._start_buffers()
        # the engine's hooks launch the all-reduces; these finish them when backward ends, and are
        # weak (`weak_grad_hook`): a wrapper nobody references is freed with its groups, as DDP is
        hook = weak_grad_hook(self)
        self._hooks = {id(p): p.register_post_accumulate_grad_hook(hook)
                       for p in held.module.parameters() if p.requires_grad}

    def restart(self, held: Holdings, retired: Sequence[torch.Tensor]) -> None:
        for param in retired:
            handle = self._hooks.pop(id(param), None)
            if handle is not None:
                handle.remove()
        hook = weak_grad_hook(self)
        for param in held.module.parameters():
            if param.requires_grad and id(param) not in self._hooks:  # first held in this round
                self._hooks[id(param)] = param.register_post_accumulate_grad_hook(hook)
        self._retire()
        self.held = held
        self.engine = self._new_engine()
        if self.broadcast and held.world_size > 1:
            self.broadcaster = ParamBroadcaster(held.module, held.plans, held.world_size)
        self._start_buffers()

    @property
    def needs_optimizer(self) -> bool:
        return self.broadcaster is not None

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._sync_enabled:  # accumulating: no averaged gradient to clip until the next sync
            self._sq_norm = None
        elif not self._finish_queued:
            self._finish_queued, self._sq_norm = True, None
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_sync)

    def _finish_sync(self) -> None:
        self._finish_queued = False
        self._sq_norm = self.engine.finish()
        if self.buffer_averager is not None:
            self.buffer_averager.average()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self._sync_enabled:  # already inside one
            yield
            return
        self._sync_enabled = False
        self._old_bytes += self.engine.bytes
        self.engine.remove_hooks()
        try:
            yield
        finally:
            self._sync_enabled = True
            self.engine = self._new_engine()

    def local_sq_norm(self, module: nn.Module, device: torch.device) -> torch.Tensor:
        if self._sq_norm is None:
            raise ConfigError("grad_norm/clip_grad_norm_ need the averaged gradient: call them after a "
                              "backward() outside no_sync()")
        return self._sq_norm.clone()

    def step_done(self, steps: int) -> None:
        self.broadcast_held()

    def broadcast_held(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.broadcast()

    def _helpers(self) -> tuple:
        return self.engine, self.broadcaster, self.buffer_averager

    def close(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self.engine.remove_hooks()


class LocalSteps(_EngineSync):
    """No gradient sent during backward: each worker takes `every` optimizer steps on its own
    subnetwork, then every held tensor becomes its holders' average (over the engine's buckets)."""

    shared_norm = False
    counts_steps = True

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every

    def check(self, mask: Mask) -> None:
        if not mask.schedule.is_static and mask.schedule.every % self.every:
            raise ConfigError(f"the mask's {mask.schedule.kind!r} schedule changes it every {mask.schedule.every} "
                              f"steps, not a multiple of local_steps={self.every}: each round of {self.every} "
                              "steps must train under one mask")

    def _new_engine(self) -> SyncEngine:
        engine = super()._new_engine()
        engine.remove_hooks()  # its buckets average parameters every H steps, no gradients
        return engine

    def start(self, held: Holdings, groups_with_singletons: Mapping, mask: Mask, *, values_agree: bool) -> None:
        self.held = held
        self.engine = self._new_engine()
        self._start_buffers()

    def restart(self, held: Holdings, retired: Sequence[torch.Tensor]) -> None:
        self._retire()
        self.held = held
        self.engine = self._new_engine()
        self._start_buffers()

    @property
    def needs_optimizer(self) -> bool:
        return True

    def step_done(self, steps: int) -> None:
        if steps % self.every == 0:
            self.average()

    def export_values(self, state: dict[str, torch.Tensor], module: nn.Module, steps: int) -> None:
        if steps % self.every and self.held.world_size > 1:  # mid-round: averages of copies
            with torch.no_grad():
                averaged = average_values(self.engine.buckets, copies=True)
            state.update({n: averaged[id(p)] for n, p in module.named_parameters() if id(p) in averaged})


class HolderFSDP(Sync):
    """FSDP2 over each block's holders (`apply_holder_fsdp`): its reduce-scatter is the holder average.
    The statistics are averaged once each training output's backward ends."""

    singleton_groups = True
    trains_schedules = False

    def __init__(self) -> None:
        self.buffer_averager: BufferAverager | None = None
        self.module: nn.Module | None = None
        self._sync_enabled = True

    def check(self, mask: Mask) -> None:
        if not mask.schedule.is_static:
            raise ConfigError(f"a mask with a {mask.schedule.kind!r} schedule trains without fsdp (FSDP's holder "
                              "meshes are fixed at construction), got fsdp=True")

    def holder_sets(self, mask: Mask) -> list[tuple[int, ...]]:
        return [tuple(int(k) for k in mask.holder_set(j)) for j in range(mask.blocks)]

    def start(self, held: Holdings, groups_with_singletons: Mapping, mask: Mask, *, values_agree: bool) -> None:
        self.module = held.module
        apply_holder_fsdp(held.module, mask, held.blocks, held.rank, held.device, groups_with_singletons)
        if held.buffer_plans and held.world_size > 1:
            self.buffer_averager = BufferAverager(held.module, held.buffer_plans, held.local_index, held.groups,
                                                  held.rank)

    def after_forward(self, output) -> None:
        if self.buffer_averager is None or not self._sync_enabled or not torch.is_grad_enabled():
            return
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                queue = torch.autograd.Variable._execution_engine.queue_callback
                leaf.register_hook(lambda grad: queue(self.buffer_averager.average) and None)
                return

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self._sync_enabled:
            yield
            return
        self._sync_enabled = False
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._sync_enabled = True
            self.module.set_requires_gradient_sync(True)

    @property
    def bytes(self) -> ByteCount:
        total = ByteCount()
        if self.buffer_averager is not None:
            total += self.buffer_averager.bytes
        return total


def choose_sync(*, broadcast: bool, fsdp: bool, local_steps: int, comm_dtype: torch.dtype | None) -> Sync:
    """The one place the wrapper's options pick its sync (the options are checked before);
    `broadcast`: backward masking's holders send their blocks' new values after each step."""
    if fsdp:
        return HolderFSDP()
    if local_steps > 1:
        return LocalSteps(local_steps)
    return Stepwise(comm_dtype=comm_dtype, broadcast=broadcast)

