"""B-SDP with FSDP over holder sets that overlap irregularly, on 4 real gloo ranks.

Held blocks reshard after forward and are all-gathered again in backward. The claim of
docs/design.md §5: no module prefetches, so every rank's FSDP collectives are one global order
restricted to the groups it belongs to (forward: the embedding's all-gather, each block's in
model order, the head's; backward: the head's reduce-scatter, each block's all-gather and
reduce-scatter in reverse model order, the embedding's all-gather and reduce-scatter last), and
collectives in such orders cannot deadlock. The ranks record
the all-gathers and reduce-scatters they dispatch, with their groups' ranks, in every step, and
the test holds each rank's list equal to that order filtered to its groups; the runs end (no
deadlock) with the losses of B-SDP without FSDP. With FSDP2's default backward prefetch the
first mask's first step hangs on every rank (tried by hand, 2026-12-06): rank 0 gathers block 0
(group {0, 1}) before it reduces block 2, while rank 1 reduces block 2 (group {0, 1, 3}) before it
gathers block 0. Run as a script, this file is the ranks' program.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow
K, STEPS = 4, 2
MASKS = {  # holder sets of sizes 1 to 4, each rank in several
    "four-blocks": np.array([[1, 0, 1, 0], [1, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1]]),
    "six-blocks": np.array([[1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1], [1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]]),
}


class Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """The all-gathers and reduce-scatters dispatched inside the mode, with their groups' ranks, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch.distributed as dist
        from torch._C._distributed_c10d import ProcessGroup

        names = {torch.ops.c10d._allgather_base_.default: "all_gather",
                 torch.ops.c10d._reduce_scatter_base_.default: "reduce_scatter"}
        if func in names:  # (output, input, process group, ...)
            group = ProcessGroup.unbox(args[2])
            self.calls.append((names[func], tuple(dist.get_process_group_ranks(group))))
        return func(*args, **(kwargs or {}))


def _config(name: str, mask_file: Path, out: Path, **kw):
    from sdp_train.trainer.config import TrainConfig

    return TrainConfig(model="llama-debug", model_overrides={"n_layers": MASKS[name].shape[1]}, mode="bsdp",
                       workers=K, active=None, mask=str(mask_file), batch_size=2, seq_len=16, seed=1,
                       warmup_steps=1, max_data_bytes=100_000, out=str(out / name), **kw)


PRELOAD = ("torch.distributed.tensor",)  # FSDP's: imported before the process group exists


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists (the shared launch
    `tests.distributed.shared_launch`, or this module's ``__main__``)."""
    from masklab import Mask, save_mask
    from sdp_train.data import build_batches
    from sdp_train.parallel.dist import get_dist_info
    from sdp_train.trainer.prepare import prepare
    from sdp_train.trainer.run import Run

    device = torch.device("cpu")
    info = get_dist_info()
    result = {}
    for name, matrix in MASKS.items():
        mask_file = out / f"{name}.json"
        if info.rank == 0:
            save_mask(Mask(matrix), mask_file)
        torch.distributed.barrier()
        for label, extra in (("engine", {}), ("fsdp", {"fsdp": True, "activation_checkpointing": True})):
            prep = prepare(_config(name, mask_file, out, **extra))
            run = Run(prep, info, device)
            batches = build_batches(prep.data, split="train", seed=0, rank=info.rank, world_size=K)
            losses, orders = [], []
            for step in range(STEPS):
                recorder = Collectives()
                with recorder:
                    losses.append(run.step(step, *next(batches))["loss"])
                orders.append(recorder.calls)
            run.close()
            result[f"{name}/{label}"] = {"losses": losses, "orders": orders}
    (out / f"rank{info.rank}.json").write_text(json.dumps(result))


def global_order(matrix: np.ndarray) -> list[tuple[str, tuple[int, ...]]]:
    """Every FSDP collective of a step in the one order all ranks follow (design.md §5)."""
    world = tuple(range(matrix.shape[0]))
    holders = [tuple(int(k) for k in np.flatnonzero(column)) for column in matrix.T]
    # units over the world: the embedding (resharded after forward, gathered again for its backward),
    # the final norm with the head (kept gathered from its forward to its backward); the root holds nothing
    forward = [("all_gather", world)] + [("all_gather", s) for s in holders] + [("all_gather", world)]
    backward = [op for s in reversed(holders) for op in (("all_gather", s), ("reduce_scatter", s))]
    return forward + [("reduce_scatter", world)] + backward + [("all_gather", world), ("reduce_scatter", world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from tests.distributed.shared_launch import shared_out

    out = shared_out(tmp_path_factory, "test_holder_fsdp_order")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(K)]


@pytest.mark.parametrize("name", MASKS)
def test_every_ranks_fsdp_collectives_are_one_global_order_restricted_to_its_groups(ranks, name):
    order = global_order(MASKS[name])
    for rank, result in enumerate(ranks):
        # a single holder's FSDP copies its block and calls no collective
        expected = [[op, list(s)] for op, s in order if rank in s and len(s) > 1]
        for step, got in enumerate(result[f"{name}/fsdp"]["orders"]):
            assert got == expected, (rank, step)


@pytest.mark.parametrize("name", MASKS)
def test_resharded_holder_fsdp_trains_the_losses_of_the_sync_engine(ranks, name):
    fsdp, engine = ranks[0][f"{name}/fsdp"]["losses"], ranks[0][f"{name}/engine"]["losses"]
    np.testing.assert_allclose(fsdp, engine, rtol=1e-5)
    assert all(r[f"{name}/fsdp"]["losses"] == fsdp for r in ranks)  # the worker mean, the same on every rank


if __name__ == "__main__":  # python -m torch.distributed.run --standalone --nproc-per-node 4 THIS_FILE OUTDIR
    import torch.distributed.tensor  # noqa: F401  (PRELOAD)

    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
