"""SDP for any ``nn.Module``, used as one uses ``DistributedDataParallel``: docs/api.md.

>>> # under torchrun, one process per worker
>>> # model = SubnetworkDataParallel(MyModel(), active=0.5)   # blocks found, mask designed
>>> # optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
>>> # loss_fn(model(x), y).backward(); model.clip_grad_norm_(1.0); optimizer.step()

`SubnetworkDataParallel` builds, in one numbered order: the blocks and the mask, this worker's
subnetwork (non-held blocks replaced by pass-throughs, MLPs cut to the held neurons, or frozen
blocks for backward masking), its initial values (identical among each block's holders), then
activation checkpointing and either FSDP2 over each block's holders or the `SyncEngine`, whose
holder-set all-reduces run during backward and are complete when ``backward()`` returns. The
user keeps their optimizer, LR schedule, data and loss; nothing here sets a learning rate.

Not here: finding blocks (`sdp_train.parallel.discovery`), cutting models (`sdp_train.parallel.masking`),
assembling the full model (`sdp_train.parallel.export`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from masklab import Mask
from sdp_train.errors import ConfigError
from sdp_train.parallel import clip_guard, grads
from sdp_train.parallel.averaging import average_values
from sdp_train.parallel.blockmap import WHOLE, SliceSpec, owned_parameters, owned_state
from sdp_train.parallel.discovery import MLPSpec, find_blocks
from sdp_train.parallel.export import assemble, save_safetensors
from sdp_train.parallel.masking import ModelLayout, describe, drop_blocks, freeze_blocks, slice_neurons
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.parts import apply_checkpointing, apply_holder_fsdp, broadcast_from_holders, resolve_mask
from sdp_train.parallel.schedule import OptimizerPlaces, gain_block, move_optimizer_state, recut_neurons, send_blocks
from sdp_train.parallel.sync import (
    BufferAverager,
    ParamBroadcaster,
    SyncEngine,
    holder_set_groups,
    plan_buckets,
    unpin_default_group,
    weak_grad_hook,
)
from sdp_train.parallel.wire import ByteCount

unpin_default_group()  # before any user group exists, or undoing what an earlier import pinned

MASKINGS = ("forward", "backward")


class SubnetworkDataParallel(nn.Module):
    """Wrap ``module`` so that this rank trains its subnetwork and averages each block among its holders.

    Every rank constructs it with the same arguments (the mask's row ``rank`` is this worker's).

    Parameters
    ----------
    module : nn.Module
        The full model, on CPU/GPU or on the meta device (then nothing is allocated for non-held
        blocks; pass ``init_state`` or ``init``).
    mask : masklab.Mask, str or os.PathLike, optional
        The K x B mask (K = world size), or a mask file. Exactly one of ``mask`` / ``active``.
    active : float, optional
        Active fraction C: design the mask with ``masklab.design`` (one design per block's neuron
        groups at level ``"neuron"``, so every worker keeps some neurons of every MLP).
    blocks : str or sequence, optional
        The maskable residual blocks: a pattern (``"model.layers.*"``), names or submodules;
        found automatically when omitted.
    level : {"block", "neuron"}
        B-SDP (a mask column per block) or N-SDP (per block and neuron group of its MLP).
    masking : {"forward", "backward"}
        Forward masking removes what a worker does not hold; backward masking (block level) keeps
        the full model, trains held blocks only and sends their new values to the others after
        each optimizer step (call `register_optimizer`).
    neuron_groups : int
        Neuron groups per MLP at level ``"neuron"``.
    mlp : MLPSpec, optional
        The MLP's projections, relative to each block, when not found automatically.
    seed : int
        Seed of the mask design.
    init_state : mapping of str to Tensor, optional
        A full-model state dict each worker takes its part from (e.g. a pretrained checkpoint).
    init : callable, optional
        ``init(module)`` initialises a model materialised from the meta device (parameters and buffers).
    device : torch.device or str, optional
        Where a meta-device model is materialised (default: CUDA if available, else CPU).
    activation_checkpointing : bool
        Recompute every held block's activations in backward.
    fsdp : bool
        Shard each held block among its holders with FSDP2 (block level, forward masking); FSDP's
        reduce-scatter then computes the holder average.
    autocast_dtype : torch.dtype, optional
        Run the forward pass under ``torch.autocast`` in this dtype (e.g. ``torch.bfloat16``);
        parameters, gradients and optimizer state stay in their own dtype (fp32 master weights).
    comm_dtype : torch.dtype, optional
        Dtype of the gradient buffers sent among holders (e.g. ``torch.bfloat16``: half the bytes).
    local_steps : int
        H. With 1 (default) the holders average every gradient during backward and agree at every
        step. With H > 1 (forward masking, without ``fsdp``) nothing is sent during backward: each
        worker takes H optimizer steps on its own subnetwork, then every held block (or neuron
        slice) is replaced by its holders' average (``kernels.overlap_average``; call
        `register_optimizer`, whose hook counts the steps): overlap averaging of forward-masked
        subnetworks, local SGD among each block's holders. A schedule's R must be a multiple of H.
        Gradient norms and clipping are then each worker's own (docs/api.md, "Local steps").
    """

    def __init__(self, module: nn.Module, *, mask: Mask | str | os.PathLike | None = None,
                 active: float | None = None, blocks: str | Sequence[str | nn.Module] | None = None,
                 level: str = "block", masking: str = "forward", neuron_groups: int = 4,
                 mlp: MLPSpec | None = None, seed: int = 0, init_state: Mapping[str, torch.Tensor] | None = None,
                 init=None, device: torch.device | str | None = None, activation_checkpointing: bool = False,
                 fsdp: bool = False, autocast_dtype: torch.dtype | None = None,
                 comm_dtype: torch.dtype | None = None, local_steps: int = 1) -> None:
        super().__init__()
        _check_options(level, masking, fsdp, comm_dtype, local_steps)
        rank, world_size = _rank_and_world()
        # 1. blocks, the full model's layout and the mask (identical on every rank)
        block_names = find_blocks(module, blocks)
        layout = describe(module, block_names, level, neuron_groups=neuron_groups, mlp=mlp)
        mask = resolve_mask(mask, active, world_size, layout, seed=seed, schedules=not fsdp)
        matrix = mask.round_matrix(0, seed=seed)  # a schedule's first round
        held_by_rank = [layout.held(matrix[r]) for r in range(world_size)]
        row = matrix[rank]
        # 2. this worker's subnetwork (state-dict names stay the full model's)
        if masking == "backward":
            freeze_blocks(module, layout, row)
            local_index: dict[str, SliceSpec] = {n: WHOLE for n in layout.tensors}
        else:
            if level == "block":
                drop_blocks(module, block_names, row)
            else:
                slice_neurons(module, layout, row)
            local_index = dict(held_by_rank[rank])
        # 3. values: materialise a meta model, take the part of init_state (else agree among holders, in 4.)
        device = _materialise(module, device, init, init_state is not None)
        self._setup(module, layout, mask, held_by_rank, local_index, device, masking=masking,
                    activation_checkpointing=activation_checkpointing, fsdp=fsdp, autocast_dtype=autocast_dtype,
                    comm_dtype=comm_dtype, init_state=init_state, values_agree=False, seed=seed,
                    local_steps=local_steps)

    @classmethod
    def from_subnetwork(cls, module: nn.Module, *, layout: ModelLayout, mask: Mask,
                        held_by_rank: Sequence[Mapping[str, SliceSpec]], local_index: Mapping[str, SliceSpec],
                        masking: str = "forward", activation_checkpointing: bool = False, fsdp: bool = False,
                        autocast_dtype: torch.dtype | None = None, comm_dtype: torch.dtype | None = None,
                        values_agree: bool = False, seed: int = 0, local_steps: int = 1) -> SubnetworkDataParallel:
        """Wrap a subnetwork this rank has already built (steps 4 and 5 of the constructor only).

        For models that know how to build a worker's part without the full model: the built-in
        families of `sdp_train.models` (``sdp train`` uses this), or your own. ``module`` holds this
        rank's part, with full-model state-dict names; ``local_index`` maps each of its tensors to
        the part of the full tensor it holds, ``held_by_rank`` gives that map for every rank, and
        ``layout`` describes the full model (its ``blocks`` and ``level``). With ``values_agree``
        the holders of every tensor already hold the same values (built from one seed), so the
        initial broadcast is skipped. A `mask` with a schedule starts in its first round,
        ``mask.round_matrix(0, seed=seed)``: build the module and ``held_by_rank`` from that (with
        forward masking, replace each block it does not hold by a `sdp_train.parallel.masking.PassThrough`,
        which keeps the block's meta-device copy: a worker that gains the block builds it from that).
        """
        _check_options(layout.level, masking, fsdp, comm_dtype, local_steps)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        params = list(module.parameters())
        device = params[0].device if params else torch.device("cpu")
        self._setup(module, layout, mask, held_by_rank, dict(local_index), device, masking=masking,
                    activation_checkpointing=activation_checkpointing, fsdp=fsdp, autocast_dtype=autocast_dtype,
                    comm_dtype=comm_dtype, init_state=None, values_agree=values_agree, seed=seed,
                    local_steps=local_steps)
        return self

    def _setup(self, module: nn.Module, layout: ModelLayout, mask: Mask,
               held_by_rank: Sequence[Mapping[str, SliceSpec]], local_index: dict[str, SliceSpec],
               device: torch.device, *, masking: str, activation_checkpointing: bool, fsdp: bool,
               autocast_dtype: torch.dtype | None, comm_dtype: torch.dtype | None,
               init_state: Mapping[str, torch.Tensor] | None, values_agree: bool, seed: int,
               local_steps: int = 1) -> None:
        """Steps 3 (values) to 5 (gradient averaging), for a module already cut to this worker's part."""
        self.rank, self.world_size = _rank_and_world()
        if not mask.schedule.is_static and fsdp:
            raise ConfigError(f"a mask with a {mask.schedule.kind!r} schedule trains without fsdp (FSDP's holder "
                              "meshes are fixed at construction), got fsdp=True")
        if not mask.schedule.is_static and mask.schedule.every % local_steps:
            raise ConfigError(f"the mask's {mask.schedule.kind!r} schedule changes it every {mask.schedule.every} "
                              f"steps, not a multiple of local_steps={local_steps}: each round of {local_steps} "
                              "steps must train under one mask")
        self.seed, self.local_steps = seed, local_steps
        self.rounds = Rounds(mask, seed, counts=not mask.schedule.is_static or local_steps > 1)
        self._average_bytes = ByteCount()  # local steps: the holder averages of parameters
        self.mask_change_bytes = ByteCount()
        """Bytes of the optimizer state moved at mask changes (a schedule), apart from gradient traffic."""
        self._old_bytes = ByteCount()  # of the engines and broadcasters that no_sync and mask changes retired
        self._optimizers: list[weakref.ref] = []
        self._places = OptimizerPlaces()  # forward masking under a schedule: where gained parameters go
        self.activation_checkpointing = activation_checkpointing
        self.level, self.masking, self.autocast_dtype, self.comm_dtype = layout.level, masking, autocast_dtype, comm_dtype
        self.layout, self.mask, self.held_by_rank, self.local_index = layout, mask, list(held_by_rank), local_index
        self.module, self.device, self.fsdp = module, device, fsdp
        if init_state is not None:
            self.load_full_state_dict(init_state)
        # the holder sets' process groups, made once (`holder_set_groups`): buckets, statistics, FSDP meshes
        shapes = {n: shape for n, (shape, _) in layout.tensors.items()}
        self.plans = plan_buckets(self.held_by_rank, layout.parameter_names, shapes=shapes)
        buffer_plans = self._buffer_plans()
        holder_sets = [p.holders for p in [*self.plans, *buffer_plans]]
        if fsdp:
            holder_sets += [tuple(int(k) for k in mask.holder_set(j)) for j in range(mask.blocks)]
        every = (holder_set_groups(holder_sets, self.world_size, singletons=fsdp) if self.world_size > 1
                 else {h: None for h in holder_sets})
        self.groups = {h: None if len(h) == 1 else g for h, g in every.items()}  # a single holder sends nothing
        if init_state is None and not values_agree and self.world_size > 1:
            broadcast_from_holders(module, self.plans, self.local_index, self.groups, self.rank)
        # 4. activation checkpointing, inside each held block
        self.held_blocks = tuple(b for b, keep in zip(layout.blocks, self._held_block_flags()) if keep)
        if activation_checkpointing:  # backward masking runs every block's backward: checkpoint them all
            apply_checkpointing([module.get_submodule(b) for b in
                                 (layout.blocks if masking == "backward" else self.held_blocks)])
        # 5. gradient averaging among holders: FSDP2 over holder meshes, or the sync engine
        self.engine: SyncEngine | None = None
        self.broadcaster: ParamBroadcaster | None = None
        self.buffer_averager: BufferAverager | None = None
        self.optimizers_registered = 0
        self._sync_enabled = local_steps == 1  # local steps: no gradient is sent, as under no_sync()
        self._sq_norm: torch.Tensor | None = None
        self._finish_queued = False
        if fsdp:
            apply_holder_fsdp(module, mask, layout.blocks, self.rank, device, every)
        else:
            self.engine = self._new_engine()
            if masking == "backward" and self.world_size > 1:
                self.broadcaster = ParamBroadcaster(module, self.plans, self.world_size)
                if not values_agree:
                    self.broadcaster.broadcast()  # non-holders' frozen copies start from the holders' values
        if buffer_plans and self.world_size > 1:
            # running statistics (BatchNorm) move with each holder's own batches: average them too
            self.buffer_averager = BufferAverager(module, buffer_plans, self.local_index, self.groups, self.rank)
        # the sync engine's hooks launch the all-reduces; these finish them when backward ends
        # weak (`weak_grad_hook`): a wrapper nobody references is freed with its groups, as DDP is
        hook = weak_grad_hook(self)
        self._hooks = {} if fsdp else {id(p): p.register_post_accumulate_grad_hook(hook)
                                       for p in module.parameters() if p.requires_grad}
        if self.world_size > 1 and local_steps == 1:  # torch's clipping would scale holders differently: warn
            clip_guard.watch(module.parameters())

    # -- construction helpers ------------------------------------------------------------------
    def _held_block_flags(self) -> list[bool]:
        row = self.rounds.matrix[self.rank].astype(bool)
        if self.level == "neuron":
            return [True] * len(self.layout.blocks)
        return list(row)

    def _buffer_plans(self) -> list:
        """The floating-point buffers' buckets (averaged after backward, not during it: one per holder set)."""
        names = self.layout.buffer_names
        shapes = {n: shape for n, (shape, _) in self.layout.tensors.items()}
        return (plan_buckets(self.held_by_rank, names, shapes=shapes, layers_per_bucket=len(names) + 1)
                if names else [])

    def _new_engine(self) -> SyncEngine:
        engine = SyncEngine(self.module, self.plans, self.local_index, self.groups, self.rank)
        if self.local_steps > 1:  # its buckets average parameters every H steps (`average`), no gradients
            engine.remove_hooks()
        if self.comm_dtype is not None:
            for bucket in engine.buckets:  # pack casts into the buffer's dtype, unpack casts back
                bucket.buffer = torch.empty_like(bucket.buffer, dtype=self.comm_dtype)
        return engine

    # -- the training step ---------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if (self.training and not self.optimizers_registered
                and ((self.masking == "backward" and self.world_size > 1) or not self.mask.schedule.is_static
                     or self.local_steps > 1)):
            raise ConfigError("backward masking sends each block's new values after the optimizer step, a "
                              "schedule changes the mask after it, and local steps average after every H-th: call "
                              "model.register_optimizer(optimizer) before training")
        if self.training and torch.is_grad_enabled():
            self.enter_next_round()
        if self.autocast_dtype is None:
            output = self.module(*args, **kwargs)
        else:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype):
                output = self.module(*args, **kwargs)
        if self.fsdp and self.buffer_averager is not None and self._sync_enabled and torch.is_grad_enabled():
            self._average_buffers_after_backward(output)
        return output

    def _average_buffers_after_backward(self, output) -> None:
        """FSDP (no gradient hooks of ours): average the statistics once this output's backward ends."""
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                queue = torch.autograd.Variable._execution_engine.queue_callback
                leaf.register_hook(lambda grad: queue(self.buffer_averager.average) and None)
                return

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
        """Backward passes inside accumulate local gradients only; the next one outside averages the sum.

        As with DDP: N-1 micro-batches under ``no_sync()``, the last outside, give the holder
        average of the N summed gradients. A mask change that is due (`enter_next_round`) is made on
        entry, before any gradient accumulates.
        """
        self.enter_next_round()
        if not self._sync_enabled:  # already inside one, or local steps (nothing is sent during backward)
            yield
            return
        self._sync_enabled = False
        if self.fsdp:
            self.module.set_requires_gradient_sync(False)
        else:
            self._old_bytes += self.engine.bytes
            self.engine.remove_hooks()
        try:
            yield
        finally:
            self._sync_enabled = True
            if self.fsdp:
                self.module.set_requires_gradient_sync(True)
            else:
                self.engine = self._new_engine()

    def register_optimizer(self, optimizer: torch.optim.Optimizer, *, hook: bool = True) -> None:
        """Backward masking: after each ``optimizer.step()``, send held blocks' new values to the others
        and, under a schedule, count the step that fixes the round (`step_done`; the mask changes when
        the next step begins, `enter_next_round`).

        With ``hook=False`` nothing is registered on `optimizer`: call `step_done` yourself after
        each step (``sdp train`` does, so that its memory meter, which files what a step allocates as
        optimizer state, sees the broadcast's buffers as temporaries of their own). Under a schedule
        the optimizer must step every parameter (build it over all of ``model.parameters()``): its
        state moves to a block's new holders at a mask change.
        """
        if (self.broadcaster is not None or not self.mask.schedule.is_static or self.local_steps > 1) and hook:
            optimizer.register_step_post_hook(_weak_step_done(weakref.ref(self)))
        self._optimizers.append(weakref.ref(optimizer))
        self.optimizers_registered += 1
        if self.masking == "forward" and not self.mask.schedule.is_static:
            self._places.add(optimizer, self.module, self.world_size)

    def step_done(self) -> None:
        """After each optimizer step (every rank): `broadcast_held`; with local steps, after every H-th
        step, `average`; under a schedule, count the step. When it ends a round whose successor holds
        other blocks, the change is due, and made when the next step begins (`enter_next_round`), so a
        run's last step moves nothing for a round that never trains."""
        self.broadcast_held()
        if not self.rounds.counts:
            return
        self.rounds.step_done()
        if self.local_steps > 1 and self.steps % self.local_steps == 0:
            self.average()

    def enter_next_round(self) -> None:
        """Make the mask change due since the last `step_done` (nothing when none is): the next
        round's mask from now on (`sdp_train.parallel.schedule`). With forward masking the blocks a worker
        gains are built and receive their parameters, buffers and optimizer state from their
        lowest-ranked old holder, and the blocks it stops holding are freed (N-SDP: the MLPs are
        re-cut); with backward masking only the optimizer state moves. The gradient averages, the
        broadcasts and requires_grad follow the new mask.

        A training ``forward`` (and `no_sync`) calls it, so a loop need not; call it yourself right
        after `step_done` when another step follows to keep the change apart from the forward pass
        (``sdp train`` does, for its memory meter). Every rank must call it (a collective when due).
        """
        matrix = self.rounds.take_due()
        if matrix is not None:
            self._enter_round(matrix, step=self.steps, move_state=True)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (counted under a schedule or with local steps)."""
        return self.rounds.steps

    @torch.no_grad()
    def average(self) -> None:
        """Local steps: replace every held tensor (block, neuron slice, shared tensor) by its average
        over its holders in the mask in force, and the floating-point buffers likewise. Every rank
        must call it (`step_done` does after every H-th step)."""
        if self.world_size == 1 or self.engine is None:
            return
        average_values(self.engine.buckets, self._average_bytes)
        if self.buffer_averager is not None:
            self.buffer_averager.average()

    def schedule_state(self) -> dict[str, int]:
        """``{"steps": optimizer steps taken}`` under a schedule or with local steps (it fixes the
        round and the next average), ``{}`` otherwise: save it with each worker's model and
        optimizer state. When a mask change is due (`enter_next_round`), the state is still the
        round's that ended: ``"mask_step"`` then names a step of that round."""
        return self.rounds.state()

    def load_schedule_state(self, state: dict[str, int]) -> None:
        """Continue from `schedule_state`; every rank calls it, after `register_optimizer` and *before*
        loading this worker's model and optimizer state: with forward masking it rebuilds the
        subnetwork of the saved round (blocks gained are empty until the state is loaded, and their
        parameters join the optimizer's groups in the saved order)."""
        saved = self.rounds.load(state, f"a {self.mask.schedule.kind!r} mask with local_steps={self.local_steps}")
        if saved is not None:  # the state to be loaded is the saved round's
            self._enter_round(saved[0], step=saved[1], move_state=False)

    def _enter_round(self, matrix: np.ndarray, *, step: int, move_state: bool) -> None:
        """Train under `matrix`, the mask of step `step`'s round, from now on (every rank calls it)."""
        new_held = [self.layout.held(matrix[r]) for r in range(self.world_size)]
        optimizers = [o for o in (ref() for ref in self._optimizers) if o is not None]
        if self.masking == "forward" and self.level == "neuron":
            self._recut(matrix, optimizers, move_state)
        elif self.masking == "forward":
            self._move_blocks(matrix, new_held, optimizers, move_state)
        elif move_state:
            move_optimizer_state(optimizers, self.module, self.layout.parameter_names, self.held_by_rank, new_held,
                                 self.rank, self.mask_change_bytes)
        held = new_held[self.rank]
        hook = weak_grad_hook(self)
        for name, param in self.module.named_parameters():
            param.requires_grad_(name in held)
            if name not in held:
                param.grad = None
            elif id(param) not in self._hooks:  # first held in this round: it needs the sync hook
                self._hooks[id(param)] = param.register_post_accumulate_grad_hook(hook)
        self.held_by_rank = new_held
        self.rounds.entered(matrix, step)
        self.held_blocks = tuple(b for b, keep in zip(self.layout.blocks, self._held_block_flags()) if keep)
        shapes = {n: shape for n, (shape, _) in self.layout.tensors.items()}
        self.plans = plan_buckets(self.held_by_rank, self.layout.parameter_names, shapes=shapes)
        buffer_plans = self._buffer_plans()
        missing = sorted({p.holders for p in [*self.plans, *buffer_plans]} - set(self.groups))
        if missing:  # every rank reaches this with the same sets (the schedule is computed, not sent)
            made = holder_set_groups(missing, self.world_size, singletons=False) if self.world_size > 1 else {}
            self.groups.update({h: None if len(h) == 1 else made.get(h) for h in missing})
        for retired in (self.engine, self.broadcaster, self.buffer_averager):
            if retired is not None:
                self._old_bytes += retired.bytes
        self.engine.remove_hooks()
        self.engine = self._new_engine()
        if self.masking == "backward" and self.world_size > 1:
            self.broadcaster = ParamBroadcaster(self.module, self.plans, self.world_size)
        self.buffer_averager = (BufferAverager(self.module, buffer_plans, self.local_index, self.groups, self.rank)
                                if buffer_plans and self.world_size > 1 else None)

    def _move_blocks(self, matrix: np.ndarray, new_held: list[dict[str, SliceSpec]],
                     optimizers: list[torch.optim.Optimizer], move_state: bool) -> None:
        """Forward masking at a change: build the blocks this worker gains, receive their values and
        optimizer state (`move_state`; on resume the loaded state fills them), free those it drops."""
        old_rows, new_rows = self.rounds.matrix.astype(bool), matrix.astype(bool)
        gained = [b for j, b in enumerate(self.layout.blocks) if new_rows[self.rank, j] and not old_rows[self.rank, j]]
        dropped = [b for j, b in enumerate(self.layout.blocks) if old_rows[self.rank, j] and not new_rows[self.rank, j]]
        for name in gained:  # a block's shared children (a shortcut) stay as they are: every worker holds them
            block = gain_block(self.module, name, self.device)
            if self.activation_checkpointing:
                apply_checkpointing([block])
            owned = dict(owned_parameters(block))
            self._places.insert({f"{name}.{n}": p for n, p in owned.items()}, self.module)
            if self.world_size > 1 and self.local_steps == 1:
                clip_guard.watch(owned.values())
        if move_state:
            send_blocks(self.module, self.layout.blocks, old_rows, new_rows, self.rank, self.device,
                        self.mask_change_bytes)
            move_optimizer_state(optimizers, self.module, self.layout.parameter_names, self.held_by_rank, new_held,
                                 self.rank, self.mask_change_bytes)
        for name in dropped:
            block = self.module.get_submodule(name)
            params = [p for _, p in owned_parameters(block)]
            self._places.remove(params)
            for param in params:
                param.grad = None
                handle = self._hooks.pop(id(param), None)
                if handle is not None:
                    handle.remove()
            block.__dict__.pop("forward", None)  # activation checkpointing's wrapper, if any
            tensors = [t for _, t in owned_state(block)]
            drop_blocks(self.module, [name], np.zeros(1, dtype=bool))  # the module keeps meta copies
            for tensor in tensors:  # free the memory even where something else still holds the tensor
                if not tensor.is_meta:
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.local_index = dict(new_held[self.rank])

    def _recut(self, matrix: np.ndarray, optimizers: list[torch.optim.Optimizer], move_state: bool) -> None:
        """N-SDP at a change: every MLP tensor re-cut to the groups held now (`recut_neurons`); on resume
        (not `move_state`) only the shapes change, the loaded state fills them."""
        old_rows, new_rows = self.rounds.matrix.astype(bool), matrix.astype(bool)
        replaced = recut_neurons(self.module, self.layout, old_rows, new_rows, self.rank, optimizers,
                                 self.mask_change_bytes, send=move_state)
        for param in replaced:
            handle = self._hooks.pop(id(param), None)
            if handle is not None:
                handle.remove()
        self.local_index = dict(self.layout.held(matrix[self.rank]))
        if self.world_size > 1 and self.local_steps == 1:
            clip_guard.watch(self.module.parameters())

    def broadcast_held(self) -> None:
        """Backward masking: send each held block's values to the workers that do not hold it (every
        rank must call it, after the optimizer step). Does nothing for forward masking."""
        if self.broadcaster is not None:
            self.broadcaster.broadcast()

    def local_grad_sq_norm(self) -> torch.Tensor:
        """This rank's share of the averaged gradient's squared 2-norm (not a collective).

        Every averaged slice is counted on exactly one of its holders, so the sum of the shares
        over all ranks is ``grad_norm() ** 2``: sum it with your own all-reduce to save one. With
        local steps no gradient is averaged: this worker's own squared norm.
        """
        if self.fsdp or self.local_steps > 1:
            return grads.squared_norm(grads.grads_of(self.module.parameters()), self.device)
        if self._sq_norm is None:
            raise ConfigError("grad_norm/clip_grad_norm_ need the averaged gradient: call them after a "
                              "backward() outside no_sync()")
        return self._sq_norm.clone()

    def grad_norm(self) -> torch.Tensor:
        """2-norm of the whole averaged gradient (every block counted once); a collective. With local
        steps: this worker's own gradient's norm (not a collective; clipping is each worker's own)."""
        return self._grad_sq_norm().sqrt()

    def _grad_sq_norm(self) -> torch.Tensor:
        sq = self.local_grad_sq_norm()
        if self.world_size > 1 and self.local_steps == 1:
            dist.all_reduce(sq)
        return sq

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so their global 2-norm is at most ``max_norm``; returns the norm.

        The norm counts every block once across ranks and every rank applies the same factor, so
        holders stay identical (``torch.nn.utils.clip_grad_norm_`` on one rank's subnetwork would
        use a different norm on every rank, and on more than one rank warns so: `sdp_train.parallel.clip_guard`).
        Every rank must call it.
        """
        if norm_type != 2.0:
            raise ConfigError(f"clip_grad_norm_ supports norm_type=2.0, got {norm_type!r}")
        if not max_norm > 0:
            raise ConfigError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm!r}")
        total_sq = self._grad_sq_norm()
        grads.clip_(grads.grads_of(self.module.parameters()), total_sq, max_norm)
        return total_sq.sqrt()

    def close(self) -> None:
        """Remove the gradient hooks, so the engine, its buffers and its process groups can be freed.

        The hooks live in C++ and keep the sync engine (and its groups' threads) alive: call this
        after the last backward and before ``destroy_process_group``, as ``sdp train`` does. The
        wrapper cannot train after it.
        """
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        if self.engine is not None:
            self.engine.remove_hooks()

    # -- the full model ------------------------------------------------------------------------
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The full model's state dict (CPU tensors), assembled from every worker. Every rank must call it.

        With ``rank0_only`` rank 0 receives it and the others get ``{}``. With local steps in the
        middle of a round (holders not yet averaged), each tensor is its holders' average, computed
        on copies: the workers' own values are left as they are.
        """
        state = self.module.state_dict()
        if self.local_steps > 1 and self.steps % self.local_steps and self.world_size > 1 and self.engine is not None:
            with torch.no_grad():
                averaged = average_values(self.engine.buckets, copies=True)
            state.update({n: averaged[id(p)] for n, p in self.module.named_parameters() if id(p) in averaged})
        return assemble(state, self.local_index, self.layout.tensors, self.held_by_rank,
                        self.rank, rank0_only=rank0_only, device=self.device, aliases=self.layout.aliases)

    def save_full(self, path: str | os.PathLike) -> None:
        """Write the full model as safetensors (a ``.safetensors`` file, or a directory with its
        ``config.json`` for a Hugging Face model). Every rank must call it; rank 0 writes."""
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0:
            save_safetensors(state, path, config=getattr(self.module, "config", None))
        if self.world_size > 1:
            dist.barrier()

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this worker's part of every tensor of a full-model state dict. A tied tensor may come
        under any of its names (a Hugging Face checkpoint keeps one)."""
        aliases = self.layout.aliases
        names = {n: [n, *(a for a, first in aliases.items() if first == n)] for n in self.layout.tensors
                 if n not in aliases}
        found = {n: next((state[m] for m in named if m in state), None) for n, named in names.items()}
        missing = [n for n, value in found.items() if value is None]
        if missing:
            raise ConfigError(f"the full state dict lacks {len(missing)} tensor(s) of the model: {missing[:5]}")
        for name, local in self.module.state_dict(keep_vars=True).items():
            if name in aliases:  # the same tensor as its first name's
                continue
            shape = self.layout.tensors[name][0]
            if tuple(found[name].shape) != shape:
                raise ConfigError(f"tensor {name!r}: the full state dict has shape {tuple(found[name].shape)}, "
                                  f"the model {shape}")
            local.copy_(self.local_index[name].take(found[name].to(local.device)))

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of the gradient averages, backward masking's broadcasts and the
        statistics' averages so far (`sdp_train.parallel.wire`); a schedule's moves are `mask_change_bytes`."""
        total = ByteCount()
        total += self._old_bytes
        total += self._average_bytes
        for counter in (self.engine, self.broadcaster, self.buffer_averager):
            if counter is not None:
                total += counter.bytes
        return total

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank passed to gradient collectives (and backward masking's broadcasts) so far."""
        return self.bytes.buffer


SDP = SubnetworkDataParallel
"""Short name of `SubnetworkDataParallel`."""


def _check_options(level: str, masking: str, fsdp: bool, comm_dtype, local_steps: int = 1) -> None:
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ConfigError(f"local_steps must be a positive integer, got {local_steps!r}")
    if local_steps > 1 and (masking != "forward" or fsdp):
        raise ConfigError(f"local_steps={local_steps} trains forward masking without fsdp (got masking={masking!r}, "
                          f"fsdp={fsdp}); backward masking with local steps, where non-holders keep their own "
                          "copies, is sdp_train.OverlapAveraging")
    if level not in ("block", "neuron"):
        raise ConfigError(f"level must be 'block' or 'neuron', got {level!r}")
    if masking not in MASKINGS:
        raise ConfigError(f"masking must be one of {MASKINGS}, got {masking!r}")
    if masking == "backward" and level != "block":
        raise ConfigError(f"backward masking works at level 'block' only, got level={level!r}")
    if fsdp and (level != "block" or masking != "forward"):
        raise ConfigError(f"fsdp=True needs level='block' and masking='forward', got {level!r}, {masking!r}")
    if comm_dtype is not None and comm_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"comm_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {comm_dtype!r}")
    if comm_dtype is not None and fsdp:
        raise ConfigError("comm_dtype applies to the sync engine; with fsdp=True FSDP's own buffers are used")


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _materialise(module: nn.Module, device, init, has_init_state: bool) -> torch.device:
    tensors = list(module.parameters()) + list(module.buffers())
    on_meta = any(t.is_meta for t in tensors)
    if device is None:
        if on_meta or not tensors:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        else:
            device = tensors[0].device
    device = torch.device(device)
    if on_meta:
        if init is None and not has_init_state:
            raise ConfigError("the model is on the meta device: pass init_state= (a full state dict) or init= "
                              "(a function that initialises its parameters and buffers)")
        unsaved = sorted(set(dict(module.named_buffers())) - set(module.state_dict()))
        if init is None and unsaved:  # e.g. Hugging Face's rotary inv_freq: no state dict carries them
            raise ConfigError(f"the meta-device model has non-persistent buffers {unsaved[:3]} that init_state= "
                              "cannot fill: pass init= to compute them, or build the model on a real device")
        module.to_empty(device=device)
        if init is not None:
            init(module)
    else:
        module.to(device)
        if init is not None:
            init(module)
    return device



__all__ = ["MLPSpec", "SDP", "SubnetworkDataParallel", "find_blocks"]


def _weak_step_done(wrapper: weakref.ref) -> Callable[..., None]:
    """An optimizer step hook that calls the wrapper's `step_done` while the wrapper exists (weak, as
    the gradient hooks are: an optimizer kept after the wrapper must not keep its groups alive)."""

    def hook(*_) -> None:
        alive = wrapper()
        if alive is not None:
            alive.step_done()

    return hook
