"""SDP for any ``nn.Module``, used as one uses ``DistributedDataParallel``: docs/api.md.

>>> # under torchrun, one process per worker
>>> # model = SubnetworkDataParallel(MyModel(), active=0.5)   # blocks found, mask designed
>>> # optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
>>> # loss_fn(model(x), y).backward(); model.clip_grad_norm_(1.0); optimizer.step()

`SubnetworkDataParallel` builds, in one numbered order, the blocks and the mask, this worker's
subnetwork, its initial values, activation checkpointing and the sync; then it delegates: the
sync (`sdp_train.parallel.strategies`) keeps holders in agreement, `Rounds` says when the mask
changes and `MaskChanges` makes the change. Its parts: docs/design.md §5.

Not here: finding blocks (`sdp_train.parallel.discovery`), cutting models (`sdp_train.parallel.masking`),
assembling the full model (`sdp_train.parallel.export`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from masklab import Mask
from sdp_train.errors import ConfigError
from sdp_train.parallel import clip_guard, grads
from sdp_train.parallel.blockmap import SliceSpec
from sdp_train.parallel.changes import MaskChanges, RoundsMixin
from sdp_train.parallel.compile import compile_backend, compile_blocks
from sdp_train.parallel.cut import cut_subnetwork
from sdp_train.parallel.discovery import MLPSpec, find_blocks
from sdp_train.parallel.forwarding import ForwardWithModelSignature, signature_of
from sdp_train.parallel.dist import rank_and_world
from sdp_train.parallel.fullmodel import FullModelMixin
from sdp_train.parallel.masking import Cut, ModelLayout
from sdp_train.parallel.parts import apply_checkpointing, broadcast_from_holders
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.strategies import Holdings, Sync, choose_sync
from sdp_train.parallel.sync import SyncEngine, holder_set_groups, plan_buckets, unpin_default_group
from sdp_train.parallel.wire import ByteCount

unpin_default_group()  # before any user group exists, or undoing what an earlier import pinned

MODEL_ATTRIBUTES = ("config", "generation_config", "main_input_name", "accepts_loss_kwargs", "loss_type",
                    "_keys_to_ignore_on_save", "name_or_path", "model_tags")
"""Attributes the wrapper reads from the wrapped model when it has none of its own: those Hugging Face's
Trainer and Accelerate read to find the inputs, the loss and the config (methods such as
``save_pretrained`` and ``generate`` would act on this worker's part alone: `save_full` saves the model)."""


class SubnetworkDataParallel(RoundsMixin, FullModelMixin, nn.Module):
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
        Active fraction C, some c/K of the K ranks (within 0.005; another C is refused, naming the K
        that realise it, as ``sdp train --active`` does): design the mask with ``masklab.design`` (one design per block's neuron
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
    compile : bool or str
        ``torch.compile`` each residual block this worker runs, one graph per block
        (`sdp_train.parallel.compile`), so the holders' collectives still start as each block's
        backward ends; True for inductor, or a backend's name (``"aot_eager"``). Not with ``fsdp``,
        activation checkpointing or a mask schedule (refused); docs/api.md, "torch.compile".
    """

    def __init__(self, module: nn.Module, *, mask: Mask | str | os.PathLike | None = None,
                 active: float | None = None, blocks: str | Sequence[str | nn.Module] | None = None,
                 level: str = "block", masking: str = "forward", neuron_groups: int = 4,
                 mlp: MLPSpec | None = None, seed: int = 0, init_state: Mapping[str, torch.Tensor] | None = None,
                 init=None, device: torch.device | str | None = None, activation_checkpointing: bool = False,
                 fsdp: bool = False, autocast_dtype: torch.dtype | None = None,
                 comm_dtype: torch.dtype | None = None, local_steps: int = 1, compile: bool | str = False) -> None:
        super().__init__()
        cut = Cut(masking, level)
        sync = _choose_sync(cut, fsdp, comm_dtype, local_steps)
        # 1. to 3. (blocks, mask, this worker's subnetwork, materialised): `cut_subnetwork`
        part = cut_subnetwork(module, mask=mask, active=active, blocks=blocks, level=level, masking=masking,
                              neuron_groups=neuron_groups, mlp=mlp, seed=seed, init=init, device=device,
                              has_init_state=init_state is not None, schedules=sync.trains_schedules)
        self._setup(*part, cut=cut,
                    activation_checkpointing=activation_checkpointing, autocast_dtype=autocast_dtype,
                    init_state=init_state, values_agree=False, seed=seed, sync=sync,
                    options=(fsdp, comm_dtype, local_steps), compile=compile)

    @classmethod
    def from_subnetwork(cls, module: nn.Module, *, layout: ModelLayout, mask: Mask,
                        held_by_rank: Sequence[Mapping[str, SliceSpec]], local_index: Mapping[str, SliceSpec],
                        masking: str = "forward", activation_checkpointing: bool = False, fsdp: bool = False,
                        autocast_dtype: torch.dtype | None = None, comm_dtype: torch.dtype | None = None,
                        values_agree: bool = False, seed: int = 0, local_steps: int = 1,
                        compile: bool | str = False, rounds: Rounds | None = None) -> SubnetworkDataParallel:
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
        ``rounds``: a position in the mask's schedule to continue from instead of its first round, whose
        matrix ``held_by_rank`` follows (`Rounds.for_survivors`: the survivors of lost workers).
        """
        cut = Cut(masking, layout.level)
        sync = _choose_sync(cut, fsdp, comm_dtype, local_steps)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        params = list(module.parameters())
        device = params[0].device if params else torch.device("cpu")
        self._setup(module, layout, mask, held_by_rank, dict(local_index), device, cut=cut,
                    activation_checkpointing=activation_checkpointing, autocast_dtype=autocast_dtype,
                    init_state=None, values_agree=values_agree, seed=seed, sync=sync,
                    options=(fsdp, comm_dtype, local_steps), compile=compile, rounds=rounds)
        return self

    def _setup(self, module: nn.Module, layout: ModelLayout, mask: Mask,
               held_by_rank: Sequence[Mapping[str, SliceSpec]], local_index: dict[str, SliceSpec],
               device: torch.device, *, cut: Cut, activation_checkpointing: bool,
               autocast_dtype: torch.dtype | None, init_state: Mapping[str, torch.Tensor] | None,
               values_agree: bool, seed: int, sync: Sync, options: tuple, compile: bool | str = False,
               rounds: Rounds | None = None) -> None:
        """Steps 3 (values) to 5 (the sync), for a module already cut to this worker's part."""
        self.rank, self.world_size = rank_and_world()
        sync.check(mask)
        self.compile_backend = _check_compile(compile, options[0], activation_checkpointing, mask)
        self.sync = sync
        self.fsdp, self.comm_dtype, self.local_steps = options  # as given; `sync` is what they chose
        self.seed, self.activation_checkpointing = seed, activation_checkpointing
        self.rounds = rounds or Rounds(mask, seed, counts=not mask.schedule.is_static or sync.counts_steps)
        self.cut, self.autocast_dtype = cut, autocast_dtype
        self.level, self.masking = cut.level, cut.masking  # the options as given
        self.layout, self.mask, self.held_by_rank, self.local_index = layout, mask, list(held_by_rank), local_index
        self.module, self.device = module, device
        watch_clipping = self.world_size > 1 and sync.shared_norm  # torch's clipping would scale holders differently
        self.changes = MaskChanges(module, layout, self.rank, self.world_size, device, cut=cut,
                                   activation_checkpointing=activation_checkpointing, watch_clipping=watch_clipping)
        self.optimizers_registered = 0
        if init_state is not None:
            self.load_full_state_dict(init_state)
        # the holder sets' process groups, made once (`holder_set_groups`): buckets, statistics, FSDP meshes
        self.groups: dict = {}
        held = self._plan()
        holder_sets = [p.holders for p in [*held.plans, *held.buffer_plans]] + sync.holder_sets(mask)
        every = (holder_set_groups(holder_sets, self.world_size, singletons=sync.singleton_groups)
                 if self.world_size > 1 else {h: None for h in holder_sets})
        self.groups.update({h: None if len(h) == 1 else g for h, g in every.items()})  # a single holder sends nothing
        if init_state is None and not values_agree and self.world_size > 1:
            broadcast_from_holders(module, self.plans, self.local_index, self.groups, self.rank)
        # 4. activation checkpointing, inside each block this worker runs
        running = cut.running_blocks(layout.blocks, self.held_blocks)
        if activation_checkpointing:
            apply_checkpointing([module.get_submodule(b) for b in running])
        # 4b. torch.compile, one graph per block it runs: the gradient hooks (step 5) fire as each block's backward ends
        if self.compile_backend is not None:
            compile_blocks(module, running, backend=self.compile_backend)
        # 5. the sync: gradient averaging among holders (FSDP2 over holder meshes, or the sync engine)
        sync.start(held, every, mask, values_agree=values_agree)
        if watch_clipping:
            clip_guard.watch(module.parameters())
        self._forward_signature = signature_of(module)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if name in MODEL_ATTRIBUTES and module is not None:
                return getattr(module, name)
            raise

    def _plan(self) -> Holdings:
        """The buckets of the mask in force (parameters, and floating-point buffers: one per holder set)."""
        rows = self.rounds.matrix[self.rank].astype(bool)
        self.held_blocks = self.cut.held_blocks(self.layout.blocks, rows)
        shapes = {n: shape for n, (shape, _) in self.layout.tensors.items()}
        self.plans = plan_buckets(self.held_by_rank, self.layout.parameter_names, shapes=shapes)
        names = self.layout.buffer_names
        buffer_plans = (plan_buckets(self.held_by_rank, names, shapes=shapes, layers_per_bucket=len(names) + 1)
                        if names else [])
        return Holdings(self.module, self.plans, buffer_plans, self.local_index, self.groups,
                        blocks=self.layout.blocks, rank=self.rank, world_size=self.world_size, device=self.device)

    @property
    def engine(self) -> SyncEngine | None:
        """The gradient sync engine (`sdp_train.parallel.sync.SyncEngine`); None under ``fsdp``."""
        return self.sync.engine

    @property
    def mask_change_bytes(self) -> ByteCount:
        """Bytes of the optimizer state moved at mask changes (a schedule), apart from gradient traffic."""
        return self.changes.bytes

    @property
    def mask_change_seconds(self) -> float:
        """Wall time of the mask changes made so far (a schedule): moves, rebuilt parts and holder groups."""
        return self.changes.seconds

    # -- the training step ---------------------------------------------------------------------
    @ForwardWithModelSignature
    def forward(self, *args, **kwargs):
        if self.training and not self.optimizers_registered and self._steps_matter:
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
        self.sync.after_forward(output)
        return output

    @property
    def _steps_matter(self) -> bool:
        """Whether each optimizer step must be reported (`step_done`)."""
        return self.sync.needs_optimizer or not self.mask.schedule.is_static

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients only; the next one outside averages the sum.

        As with DDP: N-1 micro-batches under ``no_sync()``, the last outside, give the holder
        average of the N summed gradients. A mask change that is due (`enter_next_round`) is made on
        entry, before any gradient accumulates.
        """
        self.enter_next_round()
        with self.sync.no_sync():
            yield

    def broadcast_held(self) -> None:
        """Backward masking: send each held block's values to the workers that do not hold it (every
        rank must call it, after the optimizer step). Does nothing for forward masking."""
        self.sync.broadcast_held()

    def local_grad_sq_norm(self) -> torch.Tensor:
        """This rank's share of the averaged gradient's squared 2-norm (not a collective).

        Every averaged slice is counted on exactly one of its holders, so the sum of the shares
        over all ranks is ``grad_norm() ** 2``: sum it with your own all-reduce to save one. With
        local steps no gradient is averaged: this worker's own squared norm.
        """
        return self.sync.local_sq_norm(self.module, self.device)

    def grad_norm(self) -> torch.Tensor:
        """2-norm of the whole averaged gradient (every block counted once); a collective. With local
        steps: this worker's own gradient's norm (not a collective; clipping is each worker's own)."""
        return self._grad_sq_norm().sqrt()

    def _grad_sq_norm(self) -> torch.Tensor:
        sq = self.local_grad_sq_norm()
        if self.world_size > 1 and self.sync.shared_norm:
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
        self.sync.close()

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of the gradient averages, backward masking's broadcasts and the
        statistics' averages so far (`sdp_train.parallel.wire`); a schedule's moves are `mask_change_bytes`."""
        return self.sync.bytes

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank passed to gradient collectives (and backward masking's broadcasts) so far."""
        return self.bytes.buffer


SDP = SubnetworkDataParallel
"""Short name of `SubnetworkDataParallel`."""


def _check_compile(compile: bool | str, fsdp: bool, activation_checkpointing: bool, mask: Mask) -> str | None:
    """The backend ``compile`` names (None: eager), refused with the options it does not work with."""
    backend = compile_backend(compile)
    refused = [what for what, on in (("fsdp=True", fsdp), ("activation_checkpointing=True", activation_checkpointing),
                                     (f"a {mask.schedule.kind!r} mask schedule", not mask.schedule.is_static)) if on]
    if backend is not None and refused:
        raise ConfigError(f"compile={compile!r} compiles each block of a fixed subnetwork without fsdp or activation "
                          f"checkpointing, got {', '.join(refused)} (docs/api.md, 'torch.compile')")
    return backend


def _choose_sync(cut: Cut, fsdp: bool, comm_dtype, local_steps: int) -> Sync:
    """Check the options, then pick the sync they describe (the only place that reads them)."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ConfigError(f"local_steps must be a positive integer, got {local_steps!r}")
    if local_steps > 1 and (cut.keeps_whole_model or fsdp):
        raise ConfigError(f"local_steps={local_steps} trains forward masking without fsdp (got "
                          f"masking={cut.masking!r}, fsdp={fsdp}); backward masking with local steps, where "
                          "non-holders keep their own copies, is sdp_train.OverlapAveraging")
    if fsdp and not cut.moves_blocks:
        raise ConfigError(f"fsdp=True needs level='block' and masking='forward', got {cut.level!r}, {cut.masking!r}")
    if comm_dtype is not None and comm_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"comm_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {comm_dtype!r}")
    if comm_dtype is not None and fsdp:
        raise ConfigError("comm_dtype applies to the sync engine; with fsdp=True FSDP's own buffers are used")
    return choose_sync(broadcast=cut.keeps_whole_model, fsdp=fsdp, local_steps=local_steps, comm_dtype=comm_dtype)


__all__ = ["MLPSpec", "SDP", "SubnetworkDataParallel", "find_blocks"]

