"""Overlap averaging: each worker keeps its own copy of the model, trains the blocks it holds for
H local steps, then every block is averaged among its current holders; non-holders keep theirs.

This is the regime in which the mask graph's spectral gap governs agreement (docs/design.md,
"Where the spectral gap matters"): with a schedule (``permute`` or ``cyclic``, mask changes every
R steps, R a multiple of H) a block's copies mix over rounds, as in decentralized SGD, and their
disagreement, the *consensus distance* (`OverlapAveraging.consensus_distance`), contracts at a
rate set by the gap of the expected mixing operator. With a static mask a non-holder's copy of a
block never changes. Bytes sent per step fall like 1/H: one holder average per block per round,
nothing during backward.

>>> # under torchrun, one process per worker
>>> # model = OverlapAveraging(MyModel(), active=0.5, local_steps=4)
>>> # optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
>>> # model.register_optimizer(optimizer)       # counts steps, averages after every 4th
>>> # loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()

Masking is backward masking at block level: every worker runs the whole model forward, and only
the blocks it holds in the current round take gradients (the others' ``requires_grad`` is off and
the optimizer skips them; their optimizer state, like everything else here, stays the worker's
own). Parameters outside the blocks (embeddings, head) are held by every worker and so averaged
over all of them each round, as in local SGD. Floating-point buffers (BatchNorm statistics) are
averaged with their block. Gradient clipping is local (``torch.nn.utils.clip_grad_norm_`` on this
worker's model is the right call here: no worker's gradient is averaged with another's).

After a lost worker the survivors go on with `OverlapAveraging.for_survivors` (under a schedule over their rows
of every round; `rounds_after_loss` says which rounds they must hold every block of); survivors that restore
the designed coverage then take what they newly hold from its holders (`OverlapAveraging.hand_over`;
`restore_holdings` says who sends what); a worker that rejoins gets its copy and optimizer state from
the holders (`OverlapAveraging.welcome`; `welcome_holdings` says who sends what).

Not here: stepwise SDP, in which holders agree at every step (`sdp_train.parallel.wrapper`), and overlap
averaging with forward masking, where a worker keeps a copy only of what it holds
(``SubnetworkDataParallel(..., local_steps=H)``, which moves blocks at a mask change).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from masklab import Mask, Schedule
from sdp_train.errors import ConfigError
from sdp_train.parallel.averaging import average_values
from sdp_train.parallel.blockmap import WHOLE, SliceSpec
from sdp_train.parallel.discovery import find_blocks
from sdp_train.parallel.export import save_safetensors
from sdp_train.parallel.forwarding import ForwardWithModelSignature, signature_of
from sdp_train.parallel.masking import ModelLayout, describe
from sdp_train.parallel.parts import resolve_mask
from sdp_train.parallel.rounds import Rounds
from sdp_train.parallel.changes import MoveVote, move_state_voted
from sdp_train.parallel.schedule import OptimizerPlaces, ReceivingUndo, send_parts
from sdp_train.parallel.sync import _Bucket, holder_set_groups, plan_buckets, unpin_default_group
from sdp_train.parallel.wire import ByteCount

unpin_default_group()  # as sdp_train.parallel.wrapper does: no default group pinned to interpreter shutdown


class OverlapAveraging(nn.Module):
    """Wrap ``module`` for overlap averaging among each block's holders every ``local_steps`` steps.

    Every rank constructs it with the same arguments (row ``rank`` of the round's mask is this
    worker's). All copies start from rank 0's values.

    Parameters
    ----------
    module : nn.Module
        The full model, on the device it trains on.
    mask : masklab.Mask, str or os.PathLike, optional
        The K x B mask (K = world size) or a mask file; its schedule (static, ``permute`` or
        ``cyclic`` every R steps) says which mask is in force at each step
        (``Mask.round_matrix(step, seed=seed)``). Exactly one of ``mask`` / ``active``.
    active : float, optional
        Active fraction C, some c/K of the K ranks (within 0.005; another C is refused, naming the K
        that realise it, as ``sdp train --active`` does): design the mask with ``masklab.design``.
    schedule : masklab.Schedule, optional
        Replaces the mask's schedule (e.g. ``Schedule("permute", every=4)`` with ``active=``).
    blocks : str or sequence, optional
        The maskable residual blocks (pattern, names or submodules); found automatically when omitted.
    local_steps : int
        H: optimizer steps between averages. A schedule's R must be a multiple of H, so that each
        round of H steps trains under one mask and is averaged among that mask's holders.
    seed : int
        Seed of the mask design and of a ``permute`` schedule's draws.
    """

    def __init__(self, module: nn.Module, *, mask: Mask | str | None = None, active: float | None = None,
                 schedule: Schedule | None = None, blocks: str | Sequence[str | nn.Module] | None = None,
                 local_steps: int = 1, seed: int = 0, _start_equal: bool = True) -> None:
        super().__init__()
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ConfigError(f"local_steps must be a positive integer, got {local_steps!r}")
        self.rank, self.world_size = ((dist.get_rank(), dist.get_world_size())
                                      if dist.is_available() and dist.is_initialized() else (0, 1))
        block_names = find_blocks(module, blocks)
        self.layout = describe(module, block_names, "block")
        self.mask = resolve_mask(mask, active, self.world_size, self.layout, seed=seed, schedules=True)
        if schedule is not None:
            if not isinstance(schedule, Schedule):
                raise ConfigError(f"schedule must be a masklab.Schedule, got {type(schedule).__name__}")
            self.mask = self.mask.replace(schedule=schedule)
        every = self.mask.schedule.every
        if not self.mask.schedule.is_static and every % local_steps:
            raise ConfigError(f"the mask's {self.mask.schedule.kind!r} schedule changes it every {every} steps, "
                              f"not a multiple of local_steps={local_steps}: each round of {local_steps} steps "
                              "must train under one mask")
        self.module, self.local_steps, self.seed = module, local_steps, seed
        self._forward_signature = signature_of(module)
        self.rounds = Rounds(self.mask, seed, counts=True)
        self.bytes = ByteCount()
        self.optimizers_registered = 0
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        tensors = dict(module.state_dict(keep_vars=True))
        params = set(self.layout.parameter_names)
        self._tensors = {n: tensors[n] for n in [*self.layout.parameter_names,
                                                 *(n for n, t in tensors.items()
                                                   if n not in params and t.dtype.is_floating_point
                                                   and not isinstance(t, nn.Parameter))]}
        """Every tensor averaged: the parameters (tied ones once) and the floating-point buffers."""
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._round_key: bytes | None = None
        self._buckets: list[_Bucket] = []
        self._device = next(iter(self._tensors.values())).device if self._tensors else torch.device("cpu")
        if self.world_size > 1 and _start_equal:
            with torch.no_grad():
                for t in tensors.values():  # one starting point for every copy
                    dist.broadcast(t.data, src=0)
        self._enter(self.round_matrix(0), 0)
        if self.world_size > 1:  # now, while every rank is here: made at the round's first average, a lost
            self._holder_plans(self.round_matrix(0))  # rank's missing rendezvous would wait the whole timeout

    # -- the mask in force -----------------------------------------------------------------------
    def round_matrix(self, step: int) -> np.ndarray:
        """The (K, B) mask in force at optimizer step `step` (0-based)."""
        return self.rounds.round_matrix(step)

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self.rounds.steps

    @property
    def held_blocks(self) -> tuple[str, ...]:
        """The blocks this worker trains in the current round."""
        row = self.round_matrix(self.steps)[self.rank].astype(bool)
        return tuple(b for b, keep in zip(self.layout.blocks, row) if keep)

    def _enter(self, matrix: np.ndarray, step: int) -> None:
        self.rounds.entered(matrix, step)
        held = self.layout.held(matrix[self.rank])
        for name, p in self.module.named_parameters():
            p.requires_grad_(name in held)
            if name not in held:
                p.grad = None  # the optimizer skips a parameter without a gradient

    # -- the training step -----------------------------------------------------------------------
    @ForwardWithModelSignature
    def forward(self, *args, **kwargs):
        if self.training and self.world_size > 1 and not self.optimizers_registered:
            raise ConfigError("overlap averaging counts optimizer steps: call model.register_optimizer(optimizer) "
                              "before training")
        return self.module(*args, **kwargs)

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s steps: after every ``local_steps``-th, average each block among its
        holders and switch to the next round's mask. The hooks hold this wrapper weakly."""
        self._hooks.append(optimizer.register_step_post_hook(_weak(weakref.ref(self), "step_done")))
        self.optimizers_registered += 1

    def close(self) -> None:
        """Remove the optimizer hooks and drop the holder groups (after the last collective)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._groups, self._buckets, self._round_key = [], {}, [], None

    def for_survivors(self, mask: Mask, rows: Sequence[int] | None = None) -> OverlapAveraging:
        """This wrapper over the survivors of a lost worker, in their new world (the default group
        after `sdp_train.trainer.membership` re-formed it): the same module, each worker's own copy,
        its optimizer state and the step count kept, `mask` (the survivors' rows of a static mask) in
        force. Under a schedule `rows`, the survivors' ranks in this world in their new order, give the
        position instead (`Rounds.for_survivors`: every round's mask restricted to their rows, as B-SDP
        goes on), and `mask` is not read; where the loss left the next round's change due, the survivors
        make it with `enter_due` (after taking again the average it interrupted). Call `close` on this
        one first and `register_optimizer` on the new one."""
        if self.mask.schedule.is_static:
            return self._going_on(mask, None)
        return self._going_on(mask, self.rounds.for_survivors(self._rows_given(rows, "rows", "survivors")))

    def for_joiners(self, mask: Mask, workers: Sequence[int] | None = None) -> OverlapAveraging:
        """This wrapper over a new world that workers join (the members' ranks first, the joiners' last;
        `mask` their rows of a static mask): the same module, each member's own copy and the step count
        kept, as `for_survivors`. Under a schedule `workers`, the designed mask's rows of the new world's
        ranks in their order, give the position instead (`Rounds.for_joiners`: every round from the one of
        the next step on is the designed round's rows of those workers), and `mask` is not read. Every
        rank then calls `welcome`."""
        if self.mask.schedule.is_static:
            return self._going_on(mask, None)
        return self._going_on(mask, self.rounds.for_joiners(self._rows_given(workers, "workers", "joiners")))

    def _rows_given(self, rows: Sequence[int] | None, name: str, what: str) -> Sequence[int]:
        if rows is None:
            raise ConfigError(f"overlap averaging under a {self.mask.schedule.kind!r} schedule goes on for {what} "
                              f"from its position in the schedule: pass `{name}`")
        return rows

    def _going_on(self, mask: Mask, rounds: Rounds | None) -> OverlapAveraging:
        return self.joining(self.module, mask=mask, blocks=list(self.layout.blocks), local_steps=self.local_steps,
                            seed=self.seed, steps=self.steps, rounds=rounds)

    @classmethod
    def joining(cls, module: nn.Module, *, mask: Mask | None, blocks: Sequence[str], local_steps: int, seed: int,
                steps: int, rounds: Rounds | None = None) -> OverlapAveraging:
        """A wrapper that goes on from `steps` optimizer steps taken, in a world whose copies exist already
        (a member's, a survivor's) or come afterwards (a joiner's, by `welcome`): nothing is broadcast when
        it starts. `mask`: the world's rows of a static mask; under a schedule `rounds` instead, the
        position to go on from over the world's rows of the schedule (`Rounds.for_survivors`,
        `Rounds.for_joiners`, a joiner's own from the designed mask), whose round the state is in is
        entered. Call `register_optimizer` on it."""
        # under a schedule built over the next step's round, the same on every rank (a survivor may be in the
        # round before: its average failed), whose holder groups it makes (`_holder_plans`)
        static = mask if rounds is None else Mask(rounds.round_matrix(steps), block_names=rounds.mask.block_names,
                                                  block_sizes=rounds.mask.block_sizes)
        new = cls(module, mask=static, blocks=blocks, local_steps=local_steps, seed=seed, _start_equal=False)
        new.load_schedule_state({"steps": steps})
        if rounds is not None:  # the schedule's rounds over this world's rows, from the same position
            new.mask, new.rounds = rounds.mask, rounds
            new._enter(rounds.matrix, rounds.mask_step)
        return new

    def enter_due(self) -> None:
        """Enter the round of the next step where its change is due: survivors of a loss that interrupted
        a round's average, which ends the round (`for_survivors`; the change itself only switches which
        blocks train, nothing moves), once they took the average again. Nothing where none is due."""
        due = self.rounds.take_due()
        if due is not None:
            self._enter(due, self.steps)

    def rounds_to_train(self, steps: int) -> list[tuple[int, np.ndarray]] | None:
        """Under a schedule, what a loss is checked against (`sdp_train.trainer.agreement.decide`), rows in rank
        order: first the mask of the round last trained (`trained_step`), whose average survivors take again
        when the loss came at its end, then the mask of the next step's round and of every later round of a
        run of `steps` steps, at its first step (`Rounds.to_train`). None with a static mask: the mask in
        force alone."""
        return None if self.mask.schedule.is_static else rounds_after_loss(self.rounds, steps)

    def welcome(self, optimizer: torch.optim.Optimizer, joiners: Sequence[int]) -> int:
        """Give the ranks `joiners` their copy of the model and the optimizer state of what they hold, at a
        round's boundary (right after an average, where every block's holders agree): every tensor, the
        shared ones and the blocks a joiner does not hold included, from its lowest-ranked holder among the
        members in the round last trained (under a schedule the round that ended, whose holders have just
        averaged it, where a new holder's own copy may be stale), bit for bit, and the `optimizer` state
        (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) of each parameter a joiner holds in the round of the
        next step likewise (`welcome_holdings`). A collective: every rank calls it, a joiner after building
        this wrapper and its optimizer. Returns the buffer bytes broadcast."""
        members, copies, held = welcome_holdings(self.layout, self.round_matrix(self.steps), joiners,
                                                 trained=self.round_matrix(trained_step(self.steps)))
        return self._move(optimizer, members, copies, held)

    def hand_over(self, optimizer: torch.optim.Optimizer, old_matrix: np.ndarray, vote: MoveVote | None = None
                  ) -> int:
        """Survivors that restore the designed coverage, at a round's boundary (right after the holders'
        average, where they agree), this wrapper built over the restored mask: each block a rank's row now
        gives it and `old_matrix`'s row (its rows in force until now) did not, from the block's
        lowest-ranked holder under `old_matrix`, bit for bit (a rank's own copy of a block it did not hold
        is stale), with the `optimizer` state (AdamW's ``exp_avg``, ``exp_avg_sq``, ``step``) of its
        parameters, which join `optimizer` where their holders keep them (`restore_holdings`). A block a
        rank no longer holds keeps its copy but loses its optimizer state, as any non-holder's. A
        collective: every rank calls it. Returns the buffer bytes broadcast.

        All or nothing (`vote`, `sdp_train.parallel.changes.MoveVote`): when a collective of the move fails
        or another survivor did not receive every part, this rank's copies of the blocks it gains, its
        optimizer's groups and state are put back as they were before it, and the error raised."""
        old_held, new_held = restore_holdings(self.layout, old_matrix, self.round_matrix(self.steps))
        gained = [n for n in new_held[self.rank] if n not in old_held[self.rank]]
        undo = ReceivingUndo(self.module, optimizer, gained)
        try:
            places = OptimizerPlaces()
            places.add(optimizer, self.module, self.world_size)
            places.insert({n: p for n, p in self.module.named_parameters() if n in gained}, self.module)
            return self._move(optimizer, old_held, new_held, new_held, vote)
        except RuntimeError:
            undo.undo()
            raise

    def _move(self, optimizer: torch.optim.Optimizer, sources: list[dict[str, SliceSpec]],
              values: list[dict[str, SliceSpec]], state: list[dict[str, SliceSpec]], vote: MoveVote | None = None
              ) -> int:
        """Send each tensor of `values` and the `optimizer` state of each parameter of `state` that a rank
        newly holds from its lowest-ranked holder in `sources` (`sdp_train.parallel.schedule`'s movers);
        returns the buffer bytes broadcast. With a `vote`, the state of what a rank drops goes only once
        every survivor received every part."""
        tensors = {n: t for n, t in self.layout.tensors.items() if n not in self.layout.aliases}  # a tie moves once
        moved = ByteCount()
        send_parts(self.module, tensors, sources, values, [], self.rank, self._device, moved)
        move_state_voted(vote, [optimizer], self.module, self.layout.parameter_names, sources, state, self.rank, moved)
        return moved.buffer

    def step_done(self) -> None:
        """One optimizer step has been taken (the registered hook calls this; every rank must).

        After the last step of a round, each tensor is replaced by its average over the round's
        holders, and the next round's blocks become trainable.
        """
        matrix = self.round_matrix(self.steps)
        self.rounds.step_done()
        if self.steps % self.local_steps == 0:  # R is a multiple of H: a round ends only here
            self.average(matrix)
            self.rounds.take_due()
            self._enter(self.round_matrix(self.steps), self.steps)

    def schedule_state(self) -> dict[str, int]:
        """Where training is in the schedule: ``{"steps": optimizer steps taken}``, which fixes the
        round, its mask and the next average. Save it with the model and optimizer state."""
        return self.rounds.state()

    def load_schedule_state(self, state: dict[str, int]) -> None:
        """Continue from `schedule_state` (after loading this worker's own copy and optimizer state)."""
        if isinstance(state, dict) and "mask_step" in state:  # never saved here: a change is made at once
            raise ConfigError(f"schedule state {state!r} does not fit overlap averaging: expected {{'steps': n}}")
        self.rounds.load(state, "overlap averaging")
        self._enter(self.round_matrix(self.steps), self.steps)

    @torch.no_grad()
    def average(self, matrix: np.ndarray | None = None) -> None:
        """Replace every tensor by its average over its holders in `matrix` (default: the mask in
        force now); non-holders keep their copies. A collective: every rank must call it."""
        if self.world_size == 1:
            return
        matrix = self.round_matrix(self.steps) if matrix is None else np.asarray(matrix)
        average_values([b for b in self._round_buckets(matrix) if self.rank in b.plan.holders], self.bytes)

    def _round_buckets(self, matrix: np.ndarray) -> list[_Bucket]:
        key = np.ascontiguousarray(matrix, dtype=np.int8).tobytes()
        if key == self._round_key:
            return self._buckets
        plans = self._holder_plans(matrix)
        local = {n: WHOLE for n in self._tensors}
        self._buckets = [_Bucket(p, self._tensors, local, self._groups[p.holders], self._device)
                         if self.rank in p.holders else _Placeholder(p) for p in plans]
        self._round_key = key
        return self._buckets

    def _holder_plans(self, matrix: np.ndarray) -> list:
        """The buckets of `matrix`'s averages that communicate, after making the holder groups they need that do
        not exist yet (a collective: every rank reaches it with the same sets, computed, not sent)."""
        held_by_rank = [self.layout.held(matrix[k]) for k in range(self.world_size)]
        shapes = {n: self.layout.tensors[n][0] for n in self._tensors}
        plans = [p for p in plan_buckets(held_by_rank, list(self._tensors), shapes=shapes) if len(p.holders) > 1]
        missing = sorted({p.holders for p in plans} - set(self._groups))
        if missing:
            self._groups.update(holder_set_groups(missing, self.world_size, singletons=False))
        return plans

    @property
    def comm_bytes(self) -> int:
        """Buffer bytes this rank passed to averaging all-reduces so far (``bytes.wire``: on the wire)."""
        return self.bytes.buffer

    # -- agreement and the model -----------------------------------------------------------------
    @torch.no_grad()
    def consensus_distance(self) -> dict[str, float]:
        """How far the workers' copies are apart: for every block j, (1/K) sum_k ||x_j^k - xbar_j||^2
        over the K workers' copies (xbar_j their mean), ``"other"`` for the tensors outside the
        blocks, and ``"total"`` their sum. A collective: every rank must call it; all get the result."""
        parts = self._parts()
        squares = []
        for names in parts.values():
            flat = torch.cat([self._tensors[n].detach().reshape(-1).double() for n in names]) if names else \
                torch.zeros(0, dtype=torch.float64, device=self._device)
            total = flat.clone()
            if self.world_size > 1:
                dist.all_reduce(total)
            squares.append((flat - total / self.world_size).pow(2).sum())
        deviation = torch.stack(squares) if squares else torch.zeros(0, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(deviation)
        out = {part: float(d) / self.world_size for part, d in zip(parts, deviation.tolist())}
        out["total"] = sum(out.values())
        return out

    def _parts(self) -> dict[str, list[str]]:
        parts: dict[str, list[str]] = {b: [] for b in self.layout.blocks}
        parts["other"] = []
        for name in self._tensors:
            parts[self.layout.owning_block(name) or "other"].append(name)
        return parts

    @torch.no_grad()
    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The model the holders agree on: every tensor averaged over its holders in the mask in
        force now (right after a round, each holder's own value), as CPU tensors. Integer buffers
        are rank 0's. A tied tensor is one tensor under each of its names. Every rank must call it;
        with ``rank0_only`` the others get ``{}``."""
        matrix = self.round_matrix(trained_step(self.steps))  # the last round trained
        out: dict[str, torch.Tensor] = {}
        aliases = self.layout.aliases
        for name, t in self.module.state_dict().items():
            if name in aliases:  # after its first name in state-dict order
                if aliases[name] in out:
                    out[name] = out[aliases[name]]
                continue
            value = t.detach()
            if self.world_size > 1:
                holders = self._holders_of(name, matrix)
                if value.dtype.is_floating_point:
                    value = (value if self.rank in holders else torch.zeros_like(value)).double()
                    dist.all_reduce(value)
                    value = (value / len(holders)).to(t.dtype)
                else:
                    value = value.clone()
                    dist.broadcast(value, src=0)
            if not rank0_only or self.rank == 0:
                out[name] = value.cpu().clone()
        return out

    def _holders_of(self, name: str, matrix: np.ndarray) -> tuple[int, ...]:
        block = self.layout.owning_block(name)
        if block is not None:
            return tuple(int(k) for k in np.flatnonzero(matrix[:, self.layout.blocks.index(block)]))
        return tuple(range(self.world_size))

    def save_full(self, path) -> None:
        """Write `full_state_dict` as safetensors (rank 0 writes; every rank must call it)."""
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0:
            save_safetensors(state, path, config=getattr(self.module, "config", None))
        if self.world_size > 1:
            dist.barrier()


def welcome_holdings(layout: ModelLayout, matrix: np.ndarray, joiners: Sequence[int], *,
                     trained: np.ndarray | None = None
                     ) -> tuple[list[dict[str, SliceSpec]], list[dict[str, SliceSpec]], list[dict[str, SliceSpec]]]:
    """What moves to the ranks `joiners` of an overlap-averaging world whose rows of the mask in force are
    `matrix` (under a schedule, of the round of the next step) and of the round last trained `trained`
    (default `matrix`: a static mask), as per-rank holdings for `sdp_train.parallel.schedule`'s movers,
    which send each tensor a rank newly holds from its lowest-ranked holder in the first:
    ``(members, copies, held)``.

    `members`: what each rank sends from, a member's held tensors in `trained` (blocks of its row, whose
    holders have just averaged them, and the shared tensors), a joiner's nothing. `copies`: the values each
    rank ends with, a joiner's every tensor (its copy of the whole model, the blocks it does not hold too:
    their holders' values are the freshest, and a copy of a block its worker does not hold is only read in
    the forward), a member's its `members` entry (nothing moves to a member). `held`: the tensors whose
    optimizer state each rank ends with, a joiner's those its row of `matrix` holds, a member's its
    `members` entry (a member keeps its own state, of blocks it holds in no round trained, too).

    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> layout = describe(model, ["0", "1"], "block")
    >>> members, copies, held = welcome_holdings(layout, np.array([[1, 0], [0, 1], [1, 0]]), [2])
    >>> sorted(copies[2]), sorted(held[2]), members[2]
    (['0.bias', '0.weight', '1.bias', '1.weight'], ['0.bias', '0.weight'], {})
    >>> members, _, held = welcome_holdings(layout, np.array([[0, 1], [1, 0], [0, 1]]), [2],
    ...                                     trained=np.array([[1, 0], [0, 1], [1, 0]]))
    >>> sorted(members[0]), sorted(held[0]), sorted(held[2])
    (['0.bias', '0.weight'], ['0.bias', '0.weight'], ['1.bias', '1.weight'])
    """
    trained = matrix if trained is None else trained
    members = [{} if r in joiners else layout.held(row) for r, row in enumerate(np.asarray(trained))]
    every = dict.fromkeys(layout.tensors, WHOLE)
    copies = [every if r in joiners else part for r, part in enumerate(members)]
    held = [layout.held(row) if r in joiners else members[r] for r, row in enumerate(np.asarray(matrix))]
    return members, copies, held


def rounds_after_loss(rounds: Rounds, steps: int) -> list[tuple[int, np.ndarray]]:
    """``(step, matrix)``, rows as `rounds`' ranks: the mask of the round last trained (`trained_step`) at the
    steps taken, then the mask of the next step's round and of every later round of a run of `steps` steps,
    at its first step (`Rounds.to_train`). What overlap averaging's survivors must hold every block of: the
    round whose average they take again where the loss came in it (the same whether a rank had already
    entered the next round or not), and every round they will train.

    >>> from masklab import Schedule
    >>> mask = Mask([[1, 1, 0], [0, 1, 1], [1, 0, 1]], schedule=Schedule("cyclic", every=2))
    >>> rounds = Rounds(mask, 0, counts=True)
    >>> rounds.step_done(); rounds.step_done()  # the round's average failed: round 1 not entered
    >>> [(step, matrix[0].tolist()) for step, matrix in rounds_after_loss(rounds, 5)]
    [(2, [1, 1, 0]), (2, [0, 1, 1]), (4, [1, 0, 1])]
    """
    return [(rounds.steps, rounds.round_matrix(trained_step(rounds.steps))), *rounds.to_train(steps)[1:]]


def trained_step(steps: int) -> int:
    """A step of the round last trained after `steps` optimizer steps (of round 0 before any): where a
    round's average ends it, the round whose holders agree right after it, and whose average survivors of a
    loss in it take again (`OverlapAveraging.rounds_to_train`, `welcome`).

    >>> trained_step(0), trained_step(6)
    (0, 5)
    """
    return max(steps - 1, 0)


def restore_holdings(layout: ModelLayout, old_matrix: np.ndarray, matrix: np.ndarray
                     ) -> tuple[list[dict[str, SliceSpec]], list[dict[str, SliceSpec]]]:
    """What moves when the ranks of an overlap-averaging world go from their rows `old_matrix` to `matrix`
    (survivors that restore the designed coverage), as per-rank holdings for
    `sdp_train.parallel.schedule`'s movers, which send each tensor a rank holds in the second only from
    its lowest-ranked holder in the first: ``(old_held, held)``, each rank's held tensors (its row's
    blocks and the shared tensors) under either. A block a rank gains moves to it, values and optimizer
    state; nothing moves to a rank that held the tensor already, and a shared tensor never moves.

    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> layout = describe(model, ["0", "1"], "block")
    >>> old_held, held = restore_holdings(layout, np.array([[1, 0], [0, 1]]), np.array([[1, 1], [1, 1]]))
    >>> sorted(old_held[1]), sorted(held[1])
    (['1.bias', '1.weight'], ['0.bias', '0.weight', '1.bias', '1.weight'])
    """
    return ([layout.held(row) for row in np.asarray(old_matrix)], [layout.held(row) for row in np.asarray(matrix)])


class _Placeholder:
    """A bucket this rank does not hold: it only keeps the plan (and so the global order)."""

    def __init__(self, plan) -> None:
        self.plan = plan


def _weak(ref: weakref.ref, method: str) -> Callable[..., None]:
    def hook(*_) -> None:
        alive = ref()
        if alive is not None:
            getattr(alive, method)()

    return hook


__all__ = ["OverlapAveraging", "restore_holdings", "rounds_after_loss", "trained_step", "welcome_holdings"]
