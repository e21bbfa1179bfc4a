"""Hugging Face's ``Trainer`` trains a `SubnetworkDataParallel` LLaMA on 2 gloo ranks (`SDPTrainer`).

One torchrun launch runs ``examples/train_hf_trainer.py``'s trainer (a tiny ``LlamaForCausalLM``,
2 micro-batches per step, Trainer's data loader, optimizer, LR schedule and clipping) for 3 steps
under B-SDP (``active=0.5``) and under Bb-SDP with a ``cyclic`` schedule (the workers swap halves
every step: the optimizer must be registered, and hold every parameter, for the state to move).
Each rank records, and the tests check: the batch reached the model with the columns
its forward names and without the one it does not (before the wrapper showed the model's
signature, Trainer dropped every column: ``The batch received was empty``); the trainer did not
wrap the model in DDP; the logged gradient norm is the global one, the same on both ranks, and
after Trainer's clipping the global norm is ``max_grad_norm`` (clipped through the wrapper: torch's
clipping, which warns, was never called); every holder's tensors equal the assembled full model's;
the blocks trained; and ``save_model``'s directory, and the checkpoint Trainer writes at the last
step, reload with ``from_pretrained``, every key matching and every value equal to the assembled
model. The same launch runs docs/api.md's Accelerate loop without Trainer (B-SDP): holders
identical, every block trained, the global norm clipped.

Run by hand: ``python -m torch.distributed.run --standalone --nproc-per-node 2 THIS_FILE OUTDIR``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS, MAX_GRAD_NORM = 3, 0.5
MASKINGS = ("forward", "backward")


def global_grad_norm(sdp) -> float:
    """The 2-norm of the gradient as the parameters hold it now, computed with torch alone: the two
    workers hold disjoint blocks and both hold every other tensor (the same averaged gradient), so
    the sum of the local squared norms counts those shared tensors twice."""
    import torch.distributed as dist

    grads = {n: p.grad.float() for n, p in sdp.module.named_parameters() if p.grad is not None}
    local_sq = sum(g.pow(2).sum() for g in grads.values())
    shared_sq = sum(g.pow(2).sum() for n, g in grads.items() if not any(n.startswith(f"{b}.") for b in sdp.layout.blocks))
    dist.all_reduce(local_sq)
    return (local_sq - shared_sq).sqrt().item()


def train_and_record(masking: str, out: Path, rank: int) -> dict:
    """Train with `SDPTrainer` and return what this rank saw (a collective: every rank calls it)."""
    import warnings

    from transformers import LlamaForCausalLM, TrainerCallback
    from transformers.trainer_utils import IntervalStrategy

    sys.path.insert(0, str(ROOT / "examples"))
    from train_hf_trainer import build_trainer

    from masklab import Mask, Schedule

    record: dict = {"columns": [], "clipped_norms": [], "held_by_step": []}

    class AfterClipping(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            record["clipped_norms"].append(global_grad_norm(trainer.sdp))  # every rank: a collective

        def on_step_end(self, args, state, control, **kwargs):
            record["held_by_step"].append(list(trainer.sdp.held_blocks))

    cyclic = Mask(np.array([[1, 1, 0, 0], [0, 0, 1, 1]]), schedule=Schedule("cyclic", every=1))
    trainer = build_trainer(str(out / masking), STEPS, masking=masking, mask=cyclic if masking == "backward" else None,
                            hidden_size=32, max_grad_norm=MAX_GRAD_NORM, callbacks=[AfterClipping()])
    trainer.args.save_strategy, trainer.args.save_steps = IntervalStrategy.STEPS, STEPS  # one checkpoint, at the end
    sdp = trainer.sdp
    sdp.register_forward_pre_hook(lambda m, args, kwargs: record["columns"].append(sorted(kwargs)), with_kwargs=True)
    initial = sdp.full_state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    full = sdp.full_state_dict()
    record.update(
        clip_guard_warnings=[str(w.message) for w in caught if "different norm on every rank" in str(w.message)],
        wrapped=type(trainer.model_wrapped).__name__,
        ddp_inside=any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in trainer.model_wrapped.modules()),
        logged_norms=[log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log],
        losses=[log["loss"] for log in trainer.state.log_history if "loss" in log],
        optimizers_registered=sdp.optimizers_registered,
        optimizer_lacks=[n for n, p in sdp.module.named_parameters()
                         if not any(p is q for group in trainer.optimizer.param_groups for q in group["params"])],
        moved_bytes=sdp.mask_change_bytes.buffer,
        held_blocks=list(sdp.held_blocks),
        compared=len(sdp.module.state_dict()),
        holders_differ=holders_differ(sdp, full),
        unchanged_blocks=unchanged_blocks(sdp, initial, full),
    )
    trainer.save_model(str(out / masking / "final"))
    if rank == 0:
        for saved in ("final", f"checkpoint-{STEPS}"):  # save_model's, and the checkpoint Trainer wrote
            reloaded, info = LlamaForCausalLM.from_pretrained(str(out / masking / saved), output_loading_info=True)
            state = reloaded.state_dict()
            record[saved] = {"load_info": {k: sorted(v) for k, v in info.items() if k != "error_msgs"},
                             "keys_match": sorted(state) == sorted(full),
                             "differ": [n for n in full if not torch.equal(state[n], full[n])]}
    return record


def accelerate_loop_and_record(rank: int) -> dict:
    """docs/api.md's recipe for Accelerate without Trainer: prepare the optimizer and data loader, not
    the wrapper; ``accelerator.accumulate`` runs the wrapper's ``no_sync``; clip with the wrapper."""
    import warnings

    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    from sdp_train import SubnetworkDataParallel

    sys.path.insert(0, str(ROOT / "examples"))
    from train_hf_trainer import byte_windows

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    sdp = SubnetworkDataParallel(LlamaForCausalLM(config), active=0.5)
    optimizer = torch.optim.AdamW(sdp.parameters(), lr=3e-3)
    examples = [{k: v for k, v in e.items() if k != "path"} for e in byte_windows(2 * 2 * 4 * STEPS, 64, seed=1)]
    optimizer, loader = accelerator.prepare(optimizer, DataLoader(examples, batch_size=4))
    initial, record = sdp.full_state_dict(), {"losses": [], "clipped_norms": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            with accelerator.accumulate(sdp):
                loss = sdp(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    sdp.clip_grad_norm_(MAX_GRAD_NORM)
                    record["clipped_norms"].append(global_grad_norm(sdp))
                optimizer.step()
                optimizer.zero_grad()
            record["losses"].append(loss.item())
    full = sdp.full_state_dict()
    record.update(clip_guard_warnings=[str(w.message) for w in caught if "different norm on every rank" in str(w.message)],
                  holders_differ=holders_differ(sdp, full), unchanged_blocks=unchanged_blocks(sdp, initial, full))
    return record


def holders_differ(sdp, full: dict) -> list[str]:
    """This rank's tensors that differ from their part of the assembled full model (its lowest-ranked holder's)."""
    return [n for n, t in sdp.module.state_dict().items() if not torch.equal(t, sdp.local_index[n].take(full[n]))]


def unchanged_blocks(sdp, initial: dict, full: dict) -> list[str]:
    return [b for b in sdp.layout.blocks if all(torch.equal(initial[n], full[n]) for n in full if n.startswith(f"{b}."))]


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    records = {masking: train_and_record(masking, out, rank) for masking in MASKINGS}
    records["accelerate"] = accelerate_loop_and_record(rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))


# -- the tests ---------------------------------------------------------------------------------------
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.distributed.shared_launch import shared_out

    out = shared_out(tmp_path_factory, "test_hf_trainer")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("masking", MASKINGS)
def test_the_model_gets_the_columns_its_forward_names_and_no_other(ranks, masking):
    for rank in ranks:
        columns = rank[masking]["columns"]
        assert len(columns) == 2 * STEPS  # 2 micro-batches per step, none empty
        assert all({"input_ids", "labels"} <= set(c) and "path" not in c for c in columns), columns


@pytest.mark.parametrize("masking", MASKINGS)
def test_the_trainer_does_not_wrap_the_wrapper_in_ddp_and_registers_its_optimizer(ranks, masking):
    for rank in ranks:
        assert rank[masking]["wrapped"] == "SubnetworkDataParallel" and not rank[masking]["ddp_inside"]
        assert rank[masking]["optimizers_registered"] == 1 and rank[masking]["optimizer_lacks"] == []


def test_a_schedule_moves_blocks_and_optimizer_state_between_trainer_steps(ranks):
    for rank in ranks:
        static, cyclic = rank["forward"], rank["backward"]
        assert len({tuple(h) for h in static["held_by_step"]}) == 1 and static["moved_bytes"] == 0
        held = [tuple(h) for h in cyclic["held_by_step"]]
        assert len(held) == STEPS and all(a != b for a, b in zip(held, held[1:])) and cyclic["moved_bytes"] > 0


@pytest.mark.parametrize("masking", MASKINGS)
def test_clipping_goes_through_the_wrapper_with_the_global_norm(ranks, masking):
    a, b = ranks[0][masking], ranks[1][masking]
    assert len(a["logged_norms"]) == STEPS and a["logged_norms"] == b["logged_norms"]  # one global norm
    assert all(norm > MAX_GRAD_NORM for norm in a["logged_norms"])  # so clipping had work to do
    for rank in (a, b):
        assert rank["clipped_norms"] == pytest.approx([MAX_GRAD_NORM] * STEPS, rel=1e-4)
        assert rank["clip_guard_warnings"] == []
        assert all(math.isfinite(loss) for loss in rank["losses"]) and len(rank["losses"]) == STEPS


@pytest.mark.parametrize("masking", MASKINGS)
def test_holders_are_identical_and_every_block_trained(ranks, masking):
    a, b = ranks[0][masking], ranks[1][masking]
    assert set(a["held_blocks"]).isdisjoint(b["held_blocks"])  # active=0.5 on 2 workers: a real cut
    for rank in (a, b):
        assert rank["compared"] > 0 and rank["holders_differ"] == []
        assert rank["unchanged_blocks"] == []


@pytest.mark.parametrize("saved", ["final", f"checkpoint-{STEPS}"])
@pytest.mark.parametrize("masking", MASKINGS)
def test_the_saved_model_reloads_with_from_pretrained_and_equals_the_trained_one(ranks, masking, saved):
    reloaded = ranks[0][masking][saved]
    assert reloaded["load_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert reloaded["keys_match"] and reloaded["differ"] == []



def test_an_accelerate_loop_with_the_documented_recipe_keeps_holders_identical(ranks):
    for rank in ranks:
        run = rank["accelerate"]
        assert len(run["losses"]) == 2 * STEPS and all(math.isfinite(loss) for loss in run["losses"])
        assert run["clipped_norms"] == pytest.approx([MAX_GRAD_NORM] * STEPS, rel=1e-4)
        assert run["clip_guard_warnings"] == [] and run["holders_differ"] == [] and run["unchanged_blocks"] == []


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
