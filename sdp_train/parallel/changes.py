"""Between optimizer steps: the mask's rounds and their changes on this worker.

`MaskChanges` makes the change `SubnetworkDataParallel`'s `Rounds` says is due (blocks gained and
dropped, MLPs re-cut, optimizer state moved), the change of survivors of lost workers to a mask
that restores coverage (`MaskChanges.hand_over`) and the state of workers that join a run
(`MaskChanges.welcome`); `RoundsMixin` is the wrapper's API around it
(``register_optimizer``, ``step_done``, ``enter_next_round``, the schedule state), after which the
wrapper's sync restarts over the new buckets. Not here: when a change is due
(`sdp_train.parallel.rounds`), how tensors and state are sent (`sdp_train.parallel.schedule`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sdp_train.parallel import clip_guard
from sdp_train.parallel.blockmap import WHOLE, SliceSpec, owned_parameters, owned_state
from sdp_train.parallel.masking import Cut, ModelLayout, drop_blocks
from sdp_train.parallel.parts import apply_checkpointing
from sdp_train.parallel.schedule import (
    OptimizerPlaces,
    ReceivingUndo,
    free_optimizer_state,
    gain_block,
    move_optimizer_state,
    recut_neurons,
    send_blocks,
    send_parts,
)
from sdp_train.parallel.sync import holder_set_groups
from sdp_train.parallel.wire import ByteCount


class MoveAbandoned(RuntimeError):
    """A move to restore coverage that not every survivor received whole (`MoveVote`): this rank undid its part."""


@dataclass(frozen=True)
class MoveVote:
    """All or nothing across the survivors for a move that restores coverage (`MaskChanges.hand_over`,
    `sdp_train.parallel.overlap.OverlapAveraging.hand_over`): `agreed` is called once this rank holds
    every part it gains, before it drops anything, and returns whether every survivor does (the move is
    then made), else the rank undoes what it began to receive and raises `MoveAbandoned`. `began`, once
    the values have been sent and before the optimizer state is (tests kill a worker there)."""

    agreed: Callable[[], bool]
    began: Callable[[], None] = lambda: None

    def gate(self) -> None:
        """Raise `MoveAbandoned` unless every survivor received every part of the move."""
        if not self.agreed():
            raise MoveAbandoned("another survivor did not receive every part of the move that restores coverage")


def move_state_voted(vote: MoveVote | None, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module,
                     names: Sequence[str], old_held: Sequence[dict[str, SliceSpec]],
                     new_held: Sequence[dict[str, SliceSpec]], rank: int, count: ByteCount) -> None:
    """`move_optimizer_state` from `old_held` to `new_held`. With a `vote`, all or nothing: `vote.began()`
    first, and the state of what this rank drops is freed only once every survivor received every part
    (`MoveVote.gate`, which raises `MoveAbandoned` otherwise, nothing freed)."""
    if vote is not None:
        vote.began()
    move_optimizer_state(optimizers, module, names, old_held, new_held, rank, count, free=vote is None)
    if vote is not None:
        vote.gate()
        free_optimizer_state(optimizers, module, names, old_held, new_held, rank)


class MaskChanges:
    """Changes of this worker's part of `module` (cut by `cut`) from one round's
    mask to the next; `watch_clipping` says whether new parameters join `clip_guard`'s watch."""

    def __init__(self, module: nn.Module, layout: ModelLayout, rank: int, world_size: int, device: torch.device, *,
                 cut: Cut, activation_checkpointing: bool, watch_clipping: bool) -> None:
        self.module, self.layout, self.rank, self.world_size, self.device = module, layout, rank, world_size, device
        self.moves_blocks, self.recuts = cut.moves_blocks, cut.slices_neurons
        self.activation_checkpointing, self.watch_clipping = activation_checkpointing, watch_clipping
        self.bytes = ByteCount()
        """Bytes of the optimizer state (and blocks) moved, apart from gradient traffic."""
        self.seconds = 0.0
        """Wall time of the changes of round made (`RoundsMixin._enter_round`, holder groups included)."""
        self._optimizers: list[weakref.ref] = []
        self._places = OptimizerPlaces()  # forward masking under a schedule: where gained parameters go

    def add_optimizer(self, optimizer: torch.optim.Optimizer, *, scheduled: bool) -> None:
        """Move `optimizer`'s state at changes (and, with forward masking, give it gained parameters)."""
        self._optimizers.append(weakref.ref(optimizer))
        if (self.moves_blocks or self.recuts) and scheduled:
            self._places.add(optimizer, self.module, self.world_size)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state moves at changes (`add_optimizer`), those still alive."""
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def enter(self, old_matrix: np.ndarray, matrix: np.ndarray, old_held: Sequence[dict[str, SliceSpec]],
              new_held: Sequence[dict[str, SliceSpec]], local_index: dict[str, SliceSpec], *,
              move_state: bool, vote: MoveVote | None = None) -> tuple[list[torch.Tensor], dict[str, SliceSpec]]:
        """Change this worker's part from `old_matrix`'s round to `matrix`'s (every rank calls it); on
        resume (not `move_state`) only the shapes change and the loaded state fills them. Returns the
        parameters that left the part and the new `local_index`; requires_grad follows the new mask.
        `vote`: once every part has come, and before anything is dropped, whether to go on (`MoveVote`)."""
        optimizers = self.optimizers
        old_rows, new_rows = old_matrix.astype(bool), matrix.astype(bool)
        if self.recuts:
            if vote is not None:
                vote.began()
            retired = recut_neurons(self.module, self.layout, old_rows, new_rows, self.rank, optimizers,
                                    self.bytes, send=move_state, gate=None if vote is None else vote.gate)
            if self.watch_clipping:
                clip_guard.watch(self.module.parameters())
        elif self.moves_blocks:
            retired = self._move_blocks(old_rows, new_rows, old_held, new_held, optimizers, move_state, vote)
        else:
            retired = []
            if move_state:
                move_state_voted(vote, optimizers, self.module, self.layout.parameter_names, old_held, new_held,
                                 self.rank, self.bytes)
        held = new_held[self.rank]
        for name, param in self.module.named_parameters():
            param.requires_grad_(name in held)
            if name not in held:
                param.grad = None
        return retired, (dict(held) if self.moves_blocks or self.recuts else local_index)

    def hand_over(self, optimizer: torch.optim.Optimizer, old_matrix: np.ndarray, matrix: np.ndarray,
                  old_held: Sequence[dict[str, SliceSpec]], new_held: Sequence[dict[str, SliceSpec]],
                  local_index: dict[str, SliceSpec], vote: MoveVote | None = None) -> dict[str, SliceSpec]:
        """Survivors of lost workers (this object built over their world): from `old_matrix`, their rows of
        the mask in force, to `matrix`, a mask that restores coverage, as `enter` changes rounds; every
        survivor calls it. Under backward masking every worker runs every block, but a block's values
        on a non-holder may be a step behind (a loss during the broadcast after the optimizer step), so
        the blocks a worker newly holds come from their lowest-ranked old holder too, and their
        parameters join `optimizer`, which stepped the held ones only. Returns the new `local_index`.

        All or nothing (`vote`: whether every survivor received every part): a worker keeps what it held
        until every part it gains has come; when a collective of the move fails (another worker lost) or
        the vote says another survivor's did, it drops what it began to receive (blocks built, values,
        optimizer state: `undo_gains`, `ReceivingUndo`) and raises, exactly at its state before the move."""
        gained_blocks = [b for j, b in enumerate(self.layout.blocks)
                         if matrix[self.rank, j] and not old_matrix[self.rank, j]]
        # backward masking overwrites a non-holder's own values of the blocks it gains: kept to undo
        kept = [n for n in self.module.state_dict() if not (self.moves_blocks or self.recuts)
                and any(n.startswith(f"{b}.") for b in gained_blocks)]
        undo = ReceivingUndo(self.module, optimizer, kept)
        try:
            self.add_optimizer(optimizer, scheduled=True)
            if not (self.moves_blocks or self.recuts):  # backward masking
                self._places.add(optimizer, self.module, self.world_size)
                gained = {n: p for n, p in self.module.named_parameters()
                          if n in new_held[self.rank] and n not in old_held[self.rank]}
                self._places.insert(gained, self.module)
                send_blocks(self.module, self.layout.blocks, old_matrix.astype(bool), matrix.astype(bool), self.rank,
                            self.device, self.bytes)
            return self.enter(old_matrix, matrix, old_held, new_held, local_index, move_state=True, vote=vote)[1]
        except RuntimeError:  # forward masking: the blocks built for the move go; then values, groups and state
            self.undo_gains(old_matrix)
            undo.undo()
            raise

    def welcome(self, optimizer: torch.optim.Optimizer, held: Sequence[dict[str, SliceSpec]],
                joiners: Sequence[int]) -> None:
        """Workers that join a run (ranks `joiners`, this object built over the world they joined): each
        part of their tensors (`held`, per rank; parameters, buffers, the shared ones included, N-SDP's
        neuron slices) and its `optimizer` state from its lowest-ranked holder among the others, bit
        for bit, as at a round's change whose joiners held nothing before. Under backward masking every
        worker keeps a copy of every block, whose values (the same on every worker after a step) come
        from the lowest other rank. Every rank calls it, after its wrapper exists (a joiner's part is
        built, its optimizer steps it)."""
        old = [{} if r in joiners else part for r, part in enumerate(held)]
        names = {n: t for n, t in self.layout.tensors.items() if n not in self.layout.aliases}  # a tie moves once
        if self.moves_blocks or self.recuts:
            send_parts(self.module, names, old, held, [optimizer], self.rank, self.device, self.bytes)
            return
        every = [dict.fromkeys(names, WHOLE)] * len(held)  # backward masking: values first, then the held state
        send_parts(self.module, names, [{} if r in joiners else part for r, part in enumerate(every)], every, [],
                   self.rank, self.device, self.bytes)
        move_optimizer_state([optimizer], self.module, self.layout.parameter_names, old, held, self.rank, self.bytes)

    def undo_gains(self, matrix: np.ndarray) -> None:
        """Forward masking: put back the pass-through of every block this worker built for a change that a
        lost worker interrupted (one `matrix`, the mask its state is in, does not give it), its
        parameters out of the optimizer, so that the survivors can make the change again."""
        if not self.moves_blocks:
            return
        for j, name in enumerate(self.layout.blocks):
            block = self.module.get_submodule(name)
            if matrix[self.rank, j] or hasattr(block, "shape_only"):
                continue
            params = [p for _, p in owned_parameters(block)]
            self._places.remove(params)
            block.__dict__.pop("forward", None)  # activation checkpointing's wrapper, if any
            drop_blocks(self.module, [name], np.zeros(1, dtype=bool))

    def _move_blocks(self, old_rows: np.ndarray, new_rows: np.ndarray, old_held, new_held,
                     optimizers: list[torch.optim.Optimizer], move_state: bool, vote: MoveVote | None = None
                     ) -> list[torch.Tensor]:
        """Build the blocks this worker gains, receive their values and optimizer state (`move_state`),
        free those it drops (with a `vote`, only once every survivor received every part)."""
        blocks = self.layout.blocks
        gained = [b for j, b in enumerate(blocks) if new_rows[self.rank, j] and not old_rows[self.rank, j]]
        dropped = [b for j, b in enumerate(blocks) if old_rows[self.rank, j] and not new_rows[self.rank, j]]
        for name in gained:  # a block's shared children (a shortcut) stay as they are: every worker holds them
            block = gain_block(self.module, name, self.device)
            if self.activation_checkpointing:
                apply_checkpointing([block])
            owned = dict(owned_parameters(block))
            self._places.insert({f"{name}.{n}": p for n, p in owned.items()}, self.module)
            if self.watch_clipping:
                clip_guard.watch(owned.values())
        if move_state:
            send_blocks(self.module, blocks, old_rows, new_rows, self.rank, self.device, self.bytes)
            move_state_voted(vote, optimizers, self.module, self.layout.parameter_names, old_held, new_held,
                             self.rank, self.bytes)
        retired: list[torch.Tensor] = []
        for name in dropped:
            block = self.module.get_submodule(name)
            params = [p for _, p in owned_parameters(block)]
            self._places.remove(params)
            for param in params:
                param.grad = None
            retired += params
            block.__dict__.pop("forward", None)  # activation checkpointing's wrapper, if any
            tensors = [t for _, t in owned_state(block)]
            drop_blocks(self.module, [name], np.zeros(1, dtype=bool))  # the module keeps meta copies
            for tensor in tensors:  # free the memory even where something else still holds the tensor
                if not tensor.is_meta:
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return retired


class RoundsMixin:
    """A `SubnetworkDataParallel`'s steps and rounds: what follows each optimizer step (the sync's
    broadcasts or averages) and the mask changes its `Rounds` makes due (with its `MaskChanges`)."""

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
        if self._steps_matter and hook:
            optimizer.register_step_post_hook(_weak_step_done(weakref.ref(self)))
        self.changes.add_optimizer(optimizer, scheduled=not self.mask.schedule.is_static)
        self.optimizers_registered += 1

    def step_done(self) -> None:
        """After each optimizer step (every rank): `broadcast_held`; with local steps, after every H-th
        step, `average`; under a schedule, count the step. When it ends a round whose successor holds
        other blocks, the change is due, and made when the next step begins (`enter_next_round`), so a
        run's last step moves nothing for a round that never trains."""
        if self.rounds.counts:
            self.rounds.step_done()
        self.sync.step_done(self.steps)

    def enter_next_round(self, vote: MoveVote | None = None) -> None:
        """Make the mask change due since the last `step_done` (nothing when none is): the next
        round's mask from now on (`sdp_train.parallel.schedule`). With forward masking the blocks a worker
        gains are built and receive their parameters, buffers and optimizer state from their
        lowest-ranked old holder, and the blocks it stops holding are freed (N-SDP: the MLPs are
        re-cut); with backward masking only the optimizer state moves. The gradient averages, the
        broadcasts and requires_grad follow the new mask.

        A training ``forward`` (and `no_sync`) calls it, so a loop need not; call it yourself right
        after `step_done` when another step follows to keep the change apart from the forward pass
        (``sdp train`` does, for its memory meter). Every rank must call it (a collective when due).

        `vote`: survivors of lost workers moving to a round that restores coverage (``sdp train
        --restore-coverage``): the change is all or nothing across them (`MoveVote`); when a collective
        of it fails or another survivor did not receive every part, this worker is back at its state from
        before (blocks built for it dropped, optimizer groups and state as they were) and the change is
        no longer due.
        """
        matrix = self.rounds.take_due()
        if matrix is not None:
            self._enter_round(matrix, step=self.steps, move_state=True, vote=vote)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (counted under a schedule or with local steps)."""
        return self.rounds.steps

    @torch.no_grad()
    def average(self) -> None:
        """Local steps: replace every held tensor (block, neuron slice, shared tensor) by its average
        over its holders in the mask in force, and the floating-point buffers likewise. Every rank
        must call it (`step_done` does after every H-th step)."""
        self.sync.average()

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

    def _enter_round(self, matrix: np.ndarray, *, step: int, move_state: bool,
                     vote: MoveVote | None = None) -> None:
        """Train under `matrix`, the mask of step `step`'s round, from now on (every rank calls it); with a
        `vote`, all or nothing (`enter_next_round`)."""
        began = time.perf_counter()
        new_held = [self.layout.held(matrix[r]) for r in range(self.world_size)]
        undo = [ReceivingUndo(self.module, o, []) for o in self.changes.optimizers] if vote is not None else []
        try:
            retired, self.local_index = self.changes.enter(self.rounds.matrix, matrix, self.held_by_rank, new_held,
                                                           self.local_index, move_state=move_state, vote=vote)
        except RuntimeError:  # MoveAbandoned or a failed collective: the blocks built go, then groups and state
            if vote is not None:
                self.changes.undo_gains(self.rounds.matrix)
                for each in undo:
                    each.undo()
            raise
        self.held_by_rank = new_held
        self.rounds.entered(matrix, step)
        held = self._plan()
        missing = sorted({p.holders for p in [*held.plans, *held.buffer_plans]} - set(self.groups))
        if missing:  # every rank reaches this with the same sets (the schedule is computed, not sent)
            made = holder_set_groups(missing, self.world_size, singletons=False) if self.world_size > 1 else {}
            self.groups.update({h: None if len(h) == 1 else made.get(h) for h in missing})
        self.sync.restart(held, retired)
        self.changes.seconds += time.perf_counter() - began


def _weak_step_done(wrapper: weakref.ref) -> Callable[..., None]:
    """An optimizer step hook that calls the wrapper's `step_done` while the wrapper exists (weak, as
    the gradient hooks are: an optimizer kept after the wrapper must not keep its groups alive)."""

    def hook(*_) -> None:
        alive = wrapper()
        if alive is not None:
            alive.step_done()

    return hook
