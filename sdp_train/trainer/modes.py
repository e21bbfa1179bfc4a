"""How each mode of ``sdp train`` synchronises a rank's model: one object per mode behind one small
interface (`ModeSync`), built by `build_sync` in one numbered order.

`sdp_train.trainer.run.Run` drives every mode the same way, with no mode tests in its step: the forward
pass through `ModeSync.train_model` inside `ModeSync.step_context`, backward, this rank's share of
the squared gradient norm (`ModeSync.grad_sq_norm`, summed over ranks with the loss), the norm to
report and the norm to clip by (`ModeSync.norms`), the optimizer step, then `ModeSync.after_step` and,
when another step follows, `ModeSync.enter_next_round`.
Bytes sent (`ModeSync.bytes`), long-lived communication buffers (`ModeSync.buffers`), the full
model (`ModeSync.full_state`) and the overlap-averaging extras (consensus distance, schedule
position) have one name in every mode.

| mode | object | what it wraps |
|---|---|---|
| ``ddp`` | `DataParallelSync` | torch ``DistributedDataParallel`` (the plain model on one rank) |
| ``fsdp`` | `FullyShardedSync` | FSDP2 ``fully_shard`` over the world (`sdp_train.parallel.parallelize`) |
| ``bsdp``, ``nsdp``, ``bbsdp`` | `SubnetworkSync` | `SubnetworkDataParallel`, the library API a user's loop uses |
| ``overlap`` | `OverlapSync` | `OverlapAveraging`, the library API of overlap averaging |

Not here: the optimizer, the learning-rate schedule, clipping and the loop (`sdp_train.trainer.run.Run`,
`sdp_train.trainer.train`), and the checks of a config (`sdp_train.trainer.prepare.prepare`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from masklab import Mask
from sdp_train.errors import ConfigError
from sdp_train.models import ModelConfig, block_map, build_model, family_of, model_class
from sdp_train.models.subnet import apply_backward_mask, build_worker_model, held_tensors, residual_blocks
from sdp_train.parallel import grads
from sdp_train.parallel.changes import MaskChanges, MoveVote
from sdp_train.parallel.blockmap import SliceSpec, on_meta
from sdp_train.parallel.compile import compile_backend, compile_blocks
from sdp_train.parallel.cut import Subnetwork, cut_subnetwork
from sdp_train.parallel.discovery import find_blocks
from sdp_train.parallel.dist import DistInfo
from sdp_train.parallel.masking import Cut, ModelLayout, describe, shared_inside
from sdp_train.parallel.overlap import OverlapAveraging, trained_step
from sdp_train.parallel.parallelize import parallelize
from sdp_train.parallel.rounds import Rounds, restore_step
from sdp_train.parallel.wire import ByteCount
from sdp_train.parallel.wrapper import SubnetworkDataParallel
from sdp_train.trainer.config import BASELINES
from sdp_train.trainer.user_model import NEURON_GROUPS as USER_NEURON_GROUPS
from sdp_train.trainer.user_model import UserModel, user_blocks, user_mlp


class ModeSync:
    """What a run needs of its mode; the defaults are those of a mode whose workers agree after every step.

    Attributes
    ----------
    model : nn.Module
        This rank's model: what checkpoints save and the memory meter measures.
    train_model : nn.Module
        What the forward pass goes through: `model`, or the mode's wrapper of it.
    """

    model: nn.Module
    train_model: nn.Module
    moved_bytes: int = 0
    """Buffer bytes this rank sent or received when survivors took on the blocks they newly hold
    (`for_survivors` with a mask that restores coverage); 0 where nothing moved."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info

    def trainable(self) -> list[nn.Parameter]:
        """The parameters the optimizer gets."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Register whatever the mode does at optimizer steps."""

    def step_context(self) -> ContextManager[None]:
        """Around the forward and backward pass of one step."""
        return nullcontext()

    def grad_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared gradient norm: the shares of all ranks sum to it."""
        raise NotImplementedError

    def norms(self, summed_sq: torch.Tensor, own_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the gradient norm to report, the squared norm to clip by) from the summed shares and this
        rank's own, as device tensors (nothing is read on the host)."""
        return summed_sq.sqrt(), summed_sq

    def after_step(self) -> None:
        """After the optimizer step (not after a skipped one)."""

    def enter_next_round(self, vote: MoveVote | None = None) -> None:
        """Make the mask change a schedule's round that ended made due (a collective); call it only when
        another step follows, so that nothing moves for a round that never trains. `vote`: survivors moving
        to a round that restores coverage, all or nothing (`RoundsMixin.enter_next_round`)."""

    @property
    def bytes(self) -> ByteCount:
        """Buffer and wire bytes of the mode's collectives so far (`sdp_train.parallel.wire`)."""
        return ByteCount()

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Long-lived communication buffers (the memory meter counts them as "other")."""
        return []

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full model on rank 0 (None on the other ranks); every rank must call it."""
        raise NotImplementedError

    def consensus_distance(self) -> dict[str, float] | None:
        """How far the workers' copies are apart (a collective); None where they agree."""
        return None

    @property
    def mask_change_bytes(self) -> ByteCount | None:
        """Bytes moved at mask changes (a schedule under stepwise averaging), apart from `bytes`; None
        where nothing moves."""
        return None

    @property
    def mask_change_seconds(self) -> float | None:
        """Wall time of those mask changes so far; None where nothing moves."""
        return None

    def schedule_state(self) -> dict[str, int]:
        """What a checkpoint keeps of the position in a mask schedule; ``{}`` where there is none."""
        return {}

    def load_schedule_state(self, state: dict[str, int]) -> None:
        """Continue from `schedule_state`."""

    def close(self) -> None:
        """Release hooks and process-group references (after the last collective)."""

    @property
    def schedule_rounds(self) -> Rounds | None:
        """The position in a mask schedule that `enter_next_round` follows (`Rounds`); None without one."""
        return None

    def rounds_to_train(self, steps: int) -> list[tuple[int, np.ndarray]] | None:
        """``(step, matrix)`` of the mask this rank's state is in (at the next step) and of each round
        still to train in a run of `steps` steps (`sdp_train.parallel.rounds.Rounds.to_train`), rows in
        rank order: what a loss of workers is checked against. None: the mask in force alone."""
        return None

    def for_survivors(self, mask: Mask, rows: Sequence[int], info: DistInfo,
                      optimizer: torch.optim.Optimizer, vote: MoveVote | None = None, *,
                      restore: Mapping[str, Any] | None = None) -> ModeSync:
        """This mode's sync over a new world of the survivors (`sdp_train.trainer.membership`): `rows` are
        their ranks in the old world, in the order of their new ranks, `mask` the survivors' mask (the
        old one's `rows`, or one that restores the designed coverage). Called after `close`, on the new
        default group; the model, its values and the optimizer state stay, but for what moves to a
        survivor that newly holds it (`optimizer` steps it). After a rejoin every worker "survives"
        (`rows` all of them) and `mask` is the designed one (`sdp_train.trainer.run.Run.to_designed`).
        `restore`: under a schedule, restore every round's designed coverage for the survivors
        (`Rounds.for_survivors`; the change to the restored round of the next step is then due). `vote`: a
        move that restores a static mask's coverage is all or nothing across the survivors (`MoveVote`):
        when it fails, this rank's state is what it was before this call, and this sync can be asked again."""
        raise ConfigError(f"{type(self).__name__} cannot continue after losing a worker (--on-worker-loss continue)")

    def for_joiners(self, mask: Mask, info: DistInfo, workers: Sequence[int]) -> ModeSync:
        """This mode's sync over a new world that workers join (`sdp_train.trainer.membership`): the members'
        ranks first, in their order, the joiners' last, `workers` their rows of the designed mask in that
        order and `mask` the members' rows in force and the joiners' designed rows (under a schedule, of
        the round in force), in that order. Called after `close`, on the new default group, by the
        members; each joiner builds its own (`build_sync` with ``joining``), and every rank then calls
        `welcome` (and, where a member's row is not its designed one, `for_survivors` with every worker)."""
        raise ConfigError(f"{type(self).__name__} cannot take a worker back (--max-rejoins)")

    def welcome(self, joiners: Sequence[int], optimizer: torch.optim.Optimizer) -> None:
        """Give the ranks `joiners` their values, buffers and optimizer state from the other holders (every
        rank calls it, after `for_joiners` or, on a joiner, `build_sync`); `moved_bytes` counts them."""
        raise ConfigError(f"{type(self).__name__} cannot take a worker back (--max-rejoins)")


class DataParallelSync(ModeSync):
    """``ddp``: torch DDP over the world; every rank holds the same averaged gradient."""

    def __init__(self, model: nn.Module, info: DistInfo, device: torch.device) -> None:
        super().__init__(info)
        self.model = model
        self._bytes = ByteCount()
        self.train_model = _wrap_ddp(model, device) if info.world_size > 1 else model
        # DDP's reducer all-reduces every gradient in each backward, in buckets that together hold
        # exactly their bytes: counted here, as FSDP counts its first step and SDP its buffers, so
        # that no Python comm hook taxes DDP's step alone (about 0.1 ms a bucket on CPU).
        self._step_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    @contextmanager
    def step_context(self) -> Iterator[None]:
        yield
        if self.info.world_size > 1:
            self._bytes.add("all_reduce", self._step_bytes, self.info.world_size)

    def grad_sq_norm(self) -> torch.Tensor:
        if self.info.rank != 0:  # rank 0 contributes the norm of the gradient every rank holds
            return torch.zeros((), device=_device(self.model))
        return _sq_norm(self.model)

    @property
    def bytes(self) -> ByteCount:
        return self._bytes

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Rank 0's own tensors, not copied (read them, do not write them)."""
        return {n: v.detach() for n, v in self.model.state_dict().items()} if self.info.is_main else None


class FullyShardedSync(ModeSync):
    """``fsdp``: the model sharded with FSDP2 over the world; every gradient entry lives in one rank's shard."""

    def __init__(self, model: nn.Module, info: DistInfo) -> None:
        super().__init__(info)
        self.model = self.train_model = model
        self._fsdp = FSDPStepBytes()

    def step_context(self) -> ContextManager[None]:
        return self._fsdp.counting()

    def grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm(self.model)

    @property
    def bytes(self) -> ByteCount:
        return self._fsdp.bytes

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Each tensor gathered over the world mesh, in one order on every rank."""
        state = {}
        for name, value in self.model.state_dict().items():
            value = value.full_tensor() if grads.is_dtensor(value) else value  # a collective
            if self.info.is_main:
                state[name] = value.detach()
        return state if self.info.is_main else None


class SubnetworkSync(ModeSync):
    """``bsdp``, ``nsdp``, ``bbsdp``: `SubnetworkDataParallel` averages each block among its holders
    during backward (with ``local_steps`` H > 1: its values after every H-th step), (backward
    masking) sends the holders' new values after the step and, under a schedule, moves what a
    worker gains (blocks, neuron slices, optimizer state) to it at a mask change."""

    def __init__(self, sdp: SubnetworkDataParallel, model: nn.Module, info: DistInfo, *, fsdp: bool) -> None:
        super().__init__(info)
        self.sdp, self.model, self.train_model = sdp, model, sdp
        self._fsdp = FSDPStepBytes() if fsdp else None
        self.carried_bytes = 0
        """Bytes of a move to restore coverage that every survivor made, after which their wrapper could not be
        built (`for_survivors`): counted in the `moved_bytes` of the next sync made from this one."""

    def trainable(self) -> list[nn.Parameter]:
        if self.sdp.mask.schedule.is_static:
            return super().trainable()
        return list(self.model.parameters())  # another set of blocks trains each round

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.sdp.register_optimizer(optimizer, hook=False)  # `after_step` calls step_done

    def step_context(self) -> ContextManager[None]:
        return self._fsdp.counting() if self._fsdp is not None else nullcontext()

    def grad_sq_norm(self) -> torch.Tensor:
        return self.sdp.local_grad_sq_norm()  # the holder averages finished when backward returned

    def norms(self, summed_sq: torch.Tensor, own_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stepwise: the averaged gradient's norm. Local steps: each worker trains its own subnetwork,
        so the root mean square of the workers' own norms, clipped by this worker's own."""
        if self.sdp.sync.shared_norm:
            return super().norms(summed_sq, own_sq)
        return (summed_sq / self.info.world_size).sqrt(), own_sq

    def after_step(self) -> None:
        # here, not in an optimizer hook: the memory meter would file its buffers as optimizer state
        self.sdp.step_done()

    def enter_next_round(self, vote: MoveVote | None = None) -> None:
        # outside the forward pass, where the memory meter would file what moves as activations
        self.sdp.enter_next_round(vote)

    @property
    def engine(self):
        """The gradient sync engine (`sdp_train.parallel.sync.SyncEngine`); None where no block has two holders."""
        return self.sdp.engine

    @property
    def bytes(self) -> ByteCount:
        total = self.sdp.bytes
        if self._fsdp is not None:
            total += self._fsdp.bytes
        return total

    @property
    def mask_change_bytes(self) -> ByteCount | None:
        return None if self.sdp.mask.schedule.is_static else self.sdp.mask_change_bytes

    @property
    def mask_change_seconds(self) -> float | None:
        return None if self.sdp.mask.schedule.is_static else self.sdp.mask_change_seconds

    def schedule_state(self) -> dict[str, int]:
        return self.sdp.schedule_state()

    def load_schedule_state(self, state: dict[str, int]) -> None:
        self.sdp.load_schedule_state(state)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.engine.buffers if self.engine is not None else []

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Each tensor slice from its lowest-ranked holder, one tensor at a time, summed onto rank 0."""
        state = self.sdp.full_state_dict(rank0_only=True)
        return state if self.info.is_main else None

    def close(self) -> None:
        self.sdp.close()  # its gradient hooks live in C++ and hold the engine and its groups

    def for_survivors(self, mask: Mask, rows: Sequence[int], info: DistInfo,
                      optimizer: torch.optim.Optimizer, vote: MoveVote | None = None, *,
                      restore: Mapping[str, Any] | None = None) -> SubnetworkSync:
        """Every survivor keeps its blocks, so only the wrapper is new (its holder groups, buckets and hooks);
        activation checkpointing is already inside the module. Under a schedule the new wrapper goes on from the
        same position with every round's mask restricted to the survivors' rows (`Rounds.for_survivors`; with
        `restore`, every round's mask restoring its designed coverage for them, with local steps from the boundary
        after the round the loss interrupted), after the blocks built for a change that the loss interrupted are
        dropped again (`MaskChanges.undo_gains`): the change is made again among the survivors when the next step
        begins (`Run.continue_with` makes a restore's at once). When `mask` restores the designed coverage (static
        masks), what a survivor newly holds first comes from its lowest-ranked surviving holder (blocks or neuron
        groups, their optimizer state; `MaskChanges.hand_over`, all or nothing: `vote`). With local steps each
        survivor keeps its own copy and the step count; when the last step taken ended a round and workers were
        lost, its average is taken again among the survivors, as overlap averaging's survivors do (a loss during
        the average leaves some blocks averaged with the lost copy and others not; averaging again what the
        survivors agree on changes nothing). A
        mask that restores coverage comes only at a round's boundary, with every worker kept (`Survival`: holders
        agree there), and the position goes on over it (`Rounds.over`). Under backward masking (Bb-SDP) the new
        wrapper then sends each block's values from its lowest-ranked surviving holder to every survivor: a loss
        during the broadcast that follows the optimizer step leaves some non-holders with the new values and others
        with the old (docs/design.md §7). When the wrapper cannot be built after the move was made (a worker lost
        while its holder groups form, or during Bb-SDP's broadcast), this sync, closed, describes the state the
        move left, in the survivors' world (`_moved_to`), and the error goes on: the survivors still alive agree
        again from there (`Survival._again`), and a later call goes on from that state."""
        old = self.sdp
        if self._fsdp is not None:
            return super().for_survivors(mask, rows, info, optimizer, vote)
        kept = old.rounds.matrix[list(rows)]
        held_by_rank, local_index, moved, rounds = [old.held_by_rank[r] for r in rows], old.local_index, None, None
        if old.rounds.counts:  # a schedule or local steps: the position (steps taken, round) goes on
            # with local steps a restore waits for the boundary after the round the loss interrupted
            rounds = old.rounds.for_survivors(rows, restore=None if old.mask.schedule.is_static else restore,
                                              restore_from=restore_step(old.rounds.steps, old.local_steps))
        if not old.mask.schedule.is_static:
            old.changes.undo_gains(old.rounds.matrix)
            mask = old.mask
        elif not np.array_equal(mask.matrix, kept):  # coverage restored: blocks move to their new holders
            rounds = old.rounds.over(mask) if old.rounds.counts else None  # local steps: the same steps taken
            new_held = [old.layout.held(row) for row in mask.matrix]
            changes = MaskChanges(old.module, old.layout, info.rank, info.world_size, old.device, cut=old.cut,
                                  activation_checkpointing=old.activation_checkpointing, watch_clipping=False)
            local_index = changes.hand_over(optimizer, kept, mask.matrix, held_by_rank, new_held, local_index, vote)
            held_by_rank = new_held
            moved = changes.bytes.buffer
        try:
            sdp = SubnetworkDataParallel.from_subnetwork(
                old.module, layout=old.layout, mask=mask, held_by_rank=held_by_rank,
                local_index=local_index, masking=old.masking, activation_checkpointing=False,
                autocast_dtype=old.autocast_dtype, comm_dtype=old.comm_dtype,
                values_agree=not old.cut.keeps_whole_model, seed=old.seed, local_steps=old.local_steps, rounds=rounds)
        except RuntimeError:  # a worker lost while the holder groups form (or Bb-SDP's values are sent)
            if moved is not None:  # what a survivor dropped is gone: this sync describes what the move left
                self._moved_to(mask, held_by_rank, local_index, rounds, info, moved)
            raise
        sdp.changes.bytes += old.changes.bytes  # what the schedule moved so far (`mask_change_bytes`)
        sdp.changes.seconds += old.changes.seconds
        _checkpointing_goes_on(sdp, old)
        if old.local_steps > 1 and len(rows) < old.world_size and sdp.steps and sdp.steps % old.local_steps == 0:
            sdp.average()  # the round's average, which the loss may have interrupted, among the survivors
        survivors = SubnetworkSync(sdp, sdp.module, info, fsdp=False)
        survivors.moved_bytes = (moved or 0) + self.carried_bytes
        return survivors

    def _moved_to(self, mask: Mask, held_by_rank: Sequence[Mapping[str, SliceSpec]],
                  local_index: Mapping[str, SliceSpec], rounds: Rounds | None, info: DistInfo, moved: int) -> None:
        """After the survivors made a move that restores coverage (every one received it, `MoveVote`) and their
        wrapper could not be built: this sync, closed, describes the state the move left in their world (`info`):
        `mask` in force, every rank's `held_by_rank`, this rank's `local_index`, the position `rounds` (None:
        steps not counted), so that `rounds_to_train` and `for_survivors` go on from it; `moved` bytes carried."""
        old = self.sdp
        old.mask, old.held_by_rank, old.local_index = mask, list(held_by_rank), dict(local_index)
        old.rounds = rounds or Rounds(mask, old.seed, counts=old.rounds.counts)
        old.rank, old.world_size = info.rank, info.world_size
        self.info, self.carried_bytes = info, self.carried_bytes + moved

    def for_joiners(self, mask: Mask, info: DistInfo, workers: Sequence[int]) -> SubnetworkSync:
        """Every member keeps its blocks or neuron groups (`mask` has its rows in force), so only the wrapper
        is new, over `mask`'s rows in the new world's order. Under a schedule it goes on from the same
        position (`Rounds.for_joiners`: the steps taken, every round from the one in force the designed
        round's rows of `workers`; the members made a change that was due first, `Survival.admit`; the
        state in `mask`, whose members' rows may be restored ones, the change to the designed rows due); with
        local steps from the same steps taken over `mask` (`Rounds.over`: the members' rows in force may
        be restored ones), and the members admit only right after an average, where every holder has the
        same values."""
        old = self.sdp
        if self._fsdp is not None:
            return super().for_joiners(mask, info, workers)
        rounds = None
        if not old.mask.schedule.is_static:
            rounds, mask = old.rounds.for_joiners(workers, in_force=mask.matrix), old.mask
        elif old.rounds.counts:  # local steps: the members' rows in force (restored ones too), the same steps taken
            rounds = old.rounds.over(mask)
        sdp = SubnetworkDataParallel.from_subnetwork(
            old.module, layout=old.layout, mask=mask,
            held_by_rank=[old.layout.held(row) for row in (mask.matrix if rounds is None else rounds.matrix)],
            local_index=old.local_index, masking=old.masking, activation_checkpointing=False,
            autocast_dtype=old.autocast_dtype, comm_dtype=old.comm_dtype, values_agree=True, seed=old.seed,
            local_steps=old.local_steps, rounds=rounds)
        sdp.changes.bytes += old.changes.bytes
        sdp.changes.seconds += old.changes.seconds
        _checkpointing_goes_on(sdp, old)
        return SubnetworkSync(sdp, sdp.module, info, fsdp=False)

    def welcome(self, joiners: Sequence[int], optimizer: torch.optim.Optimizer) -> None:
        """Each tensor (N-SDP: each neuron slice) a joiner holds, shared ones included, and its AdamW state
        come from the lowest-ranked other holder; in Bb-SDP every other block's values too, from the
        lowest other rank (`MaskChanges.welcome`)."""
        changes = self.sdp.changes
        before = changes.bytes.buffer
        changes.welcome(optimizer, self.sdp.held_by_rank, joiners)
        self.moved_bytes = changes.bytes.buffer - before

    def rounds_to_train(self, steps: int) -> list[tuple[int, np.ndarray]]:
        return self.sdp.rounds.to_train(steps)

    @property
    def schedule_rounds(self) -> Rounds | None:
        return None if self.sdp.mask.schedule.is_static else self.sdp.rounds


class OverlapSync(ModeSync):
    """``overlap``: `OverlapAveraging` averages each block among its holders every H steps; each
    worker trains its own copy, so its gradient norm and clipping are its own."""

    def __init__(self, overlap: OverlapAveraging, info: DistInfo) -> None:
        super().__init__(info)
        self.overlap, self.model, self.train_model = overlap, overlap.module, overlap

    def trainable(self) -> list[nn.Parameter]:
        if self.overlap.mask.schedule.is_static:  # the held blocks and shared parameters, as in B-SDP
            return super().trainable()
        return list(self.model.parameters())  # another set of blocks trains each round

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.overlap.register_optimizer(optimizer)  # averages after every local_steps-th step

    def grad_sq_norm(self) -> torch.Tensor:
        return _sq_norm(self.model)

    def norms(self, summed_sq: torch.Tensor, own_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The root mean square of the workers' own norms; clipped by this worker's own."""
        return (summed_sq / self.info.world_size).sqrt(), own_sq

    @property
    def bytes(self) -> ByteCount:
        return self.overlap.bytes

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Every tensor averaged over its holders of the last round."""
        state = self.overlap.full_state_dict(rank0_only=True)
        return state if self.info.is_main else None

    def consensus_distance(self) -> dict[str, float] | None:
        return self.overlap.consensus_distance()

    def schedule_state(self) -> dict[str, int]:
        return self.overlap.schedule_state()

    def load_schedule_state(self, state: dict[str, int]) -> None:
        self.overlap.load_schedule_state(state)

    def close(self) -> None:
        self.overlap.close()

    def for_survivors(self, mask: Mask, rows: Sequence[int], info: DistInfo,
                      optimizer: torch.optim.Optimizer, vote: MoveVote | None = None, *,
                      restore: Mapping[str, Any] | None = None) -> OverlapSync:
        """The survivors' wrapper over the same copies and optimizer states (`OverlapAveraging.for_survivors`;
        under a schedule every later round's mask restricted to the survivors' rows, `Rounds.for_survivors`).
        If workers were lost and the last step taken ended a round, its average is taken again among the
        survivors, under their rows of that round (`trained_step`): a loss during the average leaves some
        blocks averaged with the lost worker's copy and others not, while averaging again what the
        survivors already agree on changes nothing (docs/design.md §7); under a schedule they then enter
        the next round where the loss left its change due (`OverlapAveraging.enter_due`: which blocks
        train). When `mask` restores the designed coverage (a static mask; it comes only at a round's
        boundary: `Survival`), each survivor then takes the blocks it newly holds, values and AdamW
        state, from their lowest-ranked holder under those rows (`OverlapAveraging.hand_over`). After a
        rejoin every worker "survives" and `mask` is the designed one (`Run.to_designed`). `restore` (a
        schedule's) is not used: a schedule with restore_coverage is refused in overlap averaging."""
        old = self.overlap
        kept = old.round_matrix(trained_step(old.steps))[list(rows)]  # static: the rows in force
        overlap = old.for_survivors(mask, rows)
        survivors = OverlapSync(overlap, info)
        try:
            if len(rows) < old.world_size and overlap.steps and overlap.steps % overlap.local_steps == 0:
                overlap.average(kept)
            overlap.enter_due()
            if old.mask.schedule.is_static and not np.array_equal(mask.matrix, kept):  # coverage restored, or
                survivors.moved_bytes = overlap.hand_over(optimizer, kept, vote)  # after a rejoin the designed rows
        except RuntimeError:  # a worker lost meanwhile: this wrapper's groups go (the survivors agree again)
            overlap.close()
            raise
        return survivors

    def for_joiners(self, mask: Mask, info: DistInfo, workers: Sequence[int]) -> OverlapSync:
        """The members' wrapper over the same copies and step count (`OverlapAveraging.for_joiners`), `mask`
        the members' rows in force (restored ones after ``--restore-coverage``) and the joiners' designed
        rows; under a schedule the designed round's rows of `workers` from the round of the next step on
        (`Rounds.for_joiners`). The members admit only at a round's boundary, right after the average,
        where every block's holders agree (`Survival.admit`); members whose rows were restored then go
        back to their designed ones (`for_survivors` with every worker, from `Run.to_designed`)."""
        return OverlapSync(self.overlap.for_joiners(mask, workers), info)

    def rounds_to_train(self, steps: int) -> list[tuple[int, np.ndarray]] | None:
        return self.overlap.rounds_to_train(steps)

    def welcome(self, joiners: Sequence[int], optimizer: torch.optim.Optimizer) -> None:
        """Each joiner's copy of every tensor from its lowest-ranked holder among the members (the blocks it
        does not hold too), and the AdamW state of what it holds likewise (`OverlapAveraging.welcome`)."""
        self.moved_bytes = self.overlap.welcome(optimizer, joiners)


def build_sync(prep: Any, info: DistInfo, device: torch.device, *, joining: Rounds | None = None) -> ModeSync:
    """This rank's model, made and wrapped for ``prep.config.mode`` (`sdp_train.trainer.prepare.Prepared`).

    In this order: 1. the model: every rank builds the full model from the run's seed, except
    that a built-in family in B-/N-SDP builds only its worker's part and Bb-SDP freezes the
    blocks it does not hold; 2. activation checkpointing inside each block (and for ``fsdp`` the
    world's FSDP2 shards), by `sdp_train.parallel.parallelize`, where the mode's wrapper does not do it
    itself; 3. each block compiled (``--compile``; `SubnetworkDataParallel` compiles its own); 4. the mode's wrapper.
    `joining`: this rank joins a run in progress (`ModeSync.for_joiners`) at that position of the designed
    schedule (`Rounds.for_joiners`), ``prep.mask`` the new world's rows in force (its own the designed
    one, under a schedule of the round in force): its values come afterwards, from the holders
    (`ModeSync.welcome`), so the wrapper sends none when it starts, as the members' does not.
    """
    cfg, mc = prep.config, prep.model_config
    user = isinstance(mc, UserModel)
    designed = prep.mask if joining is None else joining.mask  # a joiner's prep.mask: the rows in force
    if (cfg.mode == "fsdp" or cfg.fsdp) and not dist.is_initialized():
        raise ConfigError(f"mode {cfg.mode!r} with FSDP needs torch.distributed: run under torchrun "
                          f"or with --workers >= 2 (got workers={cfg.workers})")
    # 1. the model
    if user:
        torch.manual_seed(cfg.seed)
        model = mc.build(device).to(device)
    elif cfg.mode in ("bsdp", "nsdp") and _moves_parts(cfg, designed):
        # blocks move between workers: the full model on meta, cut by the library (below), each dropped
        # block a pass-through that keeps its meta copy for the worker that gains it later
        with on_meta():
            model = model_class(mc)(mc)
    elif cfg.mode in ("bsdp", "nsdp"):
        model = build_worker_model(mc, prep.mask.matrix[info.rank].astype(bool), cfg.level, seed=cfg.seed,
                                   device=device)
    else:
        model = build_model(mc, seed=cfg.seed, device=device)
        if cfg.mode == "bbsdp":  # a schedule starts in its first round
            apply_backward_mask(model, mc, prep.mask.round_matrix(0, seed=cfg.seed)[info.rank].astype(bool))
    # 2. activation checkpointing (and FSDP), 3. compilation, where the wrapper does not apply them; 4. the wrapper
    if cfg.mode in BASELINES:
        world_mesh = DeviceMesh.from_group(dist.group.WORLD, device.type) if cfg.mode == "fsdp" else None
        if cfg.activation_checkpointing or world_mesh is not None:
            blocks = ([(n, model.get_submodule(n)) for n in _blocks(model, prep)] if user
                      else residual_blocks(model))
            parallelize(model, activation_checkpointing=cfg.activation_checkpointing, block_meshes=None,
                        root_mesh=world_mesh, blocks=blocks)
        if cfg.compile is not None:  # ddp (the config refuses fsdp): DDP's hooks fire as each block's backward ends
            compile_blocks(model, _blocks(model, prep) if user else [n for n, _ in residual_blocks(model)],
                           backend=compile_backend(cfg.compile))
        return FullyShardedSync(model, info) if cfg.mode == "fsdp" else DataParallelSync(model, info, device)
    if cfg.mode == "overlap":
        blocks = _blocks(model, prep)
        if cfg.activation_checkpointing:
            parallelize(model, activation_checkpointing=True, block_meshes=None, root_mesh=None,
                        blocks=[(n, model.get_submodule(n)) for n in blocks])
        if cfg.compile is not None:
            compile_blocks(model, blocks, backend=compile_backend(cfg.compile))
        if joining is None:
            overlap = OverlapAveraging(model, mask=prep.mask, blocks=blocks, local_steps=cfg.local_steps,
                                       seed=cfg.seed)
        else:  # at the members' step count, its copy from the holders afterwards (`ModeSync.welcome`)
            overlap = OverlapAveraging.joining(model, mask=prep.mask, blocks=blocks, local_steps=cfg.local_steps,
                                               seed=cfg.seed, steps=joining.steps,
                                               rounds=None if joining.mask.schedule.is_static else joining)
        return OverlapSync(overlap, info)
    cut = Cut("backward" if cfg.mode == "bbsdp" else "forward", cfg.level)
    library_cut = user or (_moves_parts(cfg, designed) and not cut.keeps_whole_model)
    if library_cut:
        # the full model, cut by the library; a family's seeded values: B-SDP's equal the family path's,
        # N-SDP's sliced tensors are drawn at their local shape, then each neuron group takes its
        # lowest-ranked holder's values (values_agree=False)
        part = cut_subnetwork(
            model, mask=prep.mask, blocks=_blocks(model, prep), level=cfg.level, masking=cut.masking, seed=cfg.seed,
            device=device, neuron_groups=USER_NEURON_GROUPS if user else getattr(mc, "neuron_groups", 1),
            mlp=user_mlp(cfg) if user else family_of(mc).mlp if cut.slices_neurons else None,
            init=None if user else lambda m: m.init_weights(cfg.seed))
    else:  # the family built this worker's part: every rank from the same seed, so holders agree
        rows = prep.mask.round_matrix(0, seed=cfg.seed).astype(bool)
        held_by_rank = [held_tensors(mc, rows[r], cfg.level) for r in range(info.world_size)]
        part = Subnetwork(model, family_layout(mc, cfg.level), prep.mask, held_by_rank, model.full_index(), device)
    mask, rounds = _joined_position(part.mask, joining, cfg.local_steps)
    sdp = SubnetworkDataParallel.from_subnetwork(
        part.module, layout=part.layout, mask=mask, held_by_rank=part.held_by_rank,
        local_index=part.local_index, masking=cut.masking, activation_checkpointing=cfg.activation_checkpointing,
        fsdp=cfg.fsdp, values_agree=joining is not None or not library_cut, seed=cfg.seed,
        local_steps=cfg.local_steps, compile=cfg.compile or False, rounds=rounds)
    return SubnetworkSync(sdp, sdp.module, info, fsdp=cfg.fsdp)


def _joined_position(mask: Mask, joining: Rounds | None, local_steps: int) -> tuple[Mask, Rounds | None]:
    """The mask a joiner's wrapper trains and the position it goes on from where the run keeps one (a
    schedule, local steps): under a schedule the designed mask, its rounds over the new world's workers
    (`joining`, as the members' wrapper goes on); with local steps `mask`, the new world's rows, at the
    steps taken. Else `mask` and None: the wrapper starts its own."""
    if joining is None or (joining.mask.schedule.is_static and local_steps == 1):
        return mask, None
    return (mask, joining.over(mask)) if joining.mask.schedule.is_static else (joining.mask, joining)


def _checkpointing_goes_on(sdp: SubnetworkDataParallel, old: SubnetworkDataParallel) -> None:
    """A survivors' or members' wrapper is built with ``activation_checkpointing=False``, since the blocks it
    keeps are checkpointed inside already; the blocks it gains at later mask changes or hand-overs, and the
    wrapper after it, must still be checkpointed as the run's are."""
    sdp.activation_checkpointing = sdp.changes.activation_checkpointing = old.activation_checkpointing


def _moves_parts(cfg: Any, mask: Mask) -> bool:
    """Whether the library cuts a built-in family's model in B-SDP and N-SDP, so that its parts can move
    between workers: under a schedule (`mask`, the run's), and in B-SDP when survivors of a loss restore
    the coverage (N-SDP re-cuts the family's own MLPs: `family_layout`)."""
    return not mask.schedule.is_static or (cfg.restore_coverage and cfg.mode == "bsdp")


def _blocks(model: nn.Module, prep: Any) -> list[str]:
    """The maskable residual blocks' names: a built-in family's, or those found in a user's model."""
    if isinstance(prep.model_config, UserModel):  # found and checked once, by `prepare`
        return list(prep.blocks) if prep.blocks is not None else find_blocks(model, user_blocks(prep.config))
    return list(block_map(prep.model_config).block_names("block"))


def family_layout(config: ModelConfig, level: str) -> ModelLayout:
    """The library API's `ModelLayout` of a built-in family's full model: every tensor's shape and dtype,
    the parameters in state-dict order and the blocks (at block level; N-SDP's columns are their groups,
    and for a family that names its MLP, the layout knows its neuron tensors, so that a worker's
    groups can be re-cut: `sdp_train.parallel.schedule.recut_neurons`)."""
    bmap = block_map(config)
    blocks = bmap.block_names("block")
    with on_meta():  # dtypes of every full-model tensor, including ones not held here
        full = model_class(config)(config)
    mlp = family_of(config).mlp
    if level == "neuron" and mlp is not None:
        return describe(full, blocks, level, neuron_groups=config.neuron_groups, mlp=mlp)
    dtypes = {n: t.dtype for n, t in full.state_dict().items()}
    tensors = {n: (tuple(shape), dtypes[n]) for n, shape in bmap.shapes.items()}
    params = tuple(n for n in bmap.shapes if n in bmap.parameter_names)
    return ModelLayout(tensors, params, blocks, level, shared_inside=shared_inside(full, blocks))


class FSDPStepBytes:
    """FSDP2's collective bytes per step, counted on the first step and added on every step.

    FSDP's collectives are the same on every step; intercepting every operation of every step
    would tax FSDP's step time alone (about 1.33x CPU time), so only the first step is counted.
    """

    def __init__(self) -> None:
        self.bytes = ByteCount()
        self._per_step: ByteCount | None = None

    @contextmanager
    def counting(self) -> Iterator[None]:
        if self._per_step is None:
            counter = FSDPCollectiveBytes()
            with counter:
                yield
            self._per_step = counter.bytes
        else:
            yield
        self.bytes += self._per_step


class FSDPCollectiveBytes(TorchDispatchMode):
    """Counts the bytes of FSDP2's all-gathers and reduce-scatters as they are dispatched.

    Each collective counts its full (unsharded) buffer as buffer bytes, as an all-reduce counts
    its buffer; its group size is the ratio of the full buffer to the shard (FSDP2 pads shards to
    equal size). `FSDPStepBytes` uses it for the first step only: intercepting every op costs step time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = ByteCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d._allgather_base_.default:  # (output, input shard, ...)
            self._count("all_gather", full=args[0], shard=args[1])
        elif func is torch.ops.c10d._reduce_scatter_base_.default:  # (output shard, input, ...)
            self._count("reduce_scatter", full=args[1], shard=args[0])
        return func(*args, **(kwargs or {}))

    def _count(self, collective: str, *, full: torch.Tensor, shard: torch.Tensor) -> None:
        ranks = full.numel() // shard.numel() if shard.numel() else 1
        self.bytes.add(collective, full.numel() * full.element_size(), ranks)


def _wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """torch DDP with its built-in (C++) all-reduce: no Python hook per bucket (`DataParallelSync` counts the bytes)."""
    return nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])


def _sq_norm(model: nn.Module) -> torch.Tensor:
    """The squared norm of this rank's gradients (local shards under FSDP)."""
    return grads.squared_norm(grads.grads_of(model.parameters()), _device(model))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device

