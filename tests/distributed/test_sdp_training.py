"""SDP on real gloo process groups (torchrun, several ranks on CPU) against independent references.

The references are single-process computations built only from the mask and the model's block
map: every worker's subnetwork gradient on that worker's batch, scattered into full-model
coordinates and averaged over the workers that hold each entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, save_mask
from masklab.constructions import complete
from sdp_train.models import block_map, build_model, get_model_config
from sdp_train.models.subnet import build_worker_model, held_tensors
from sdp_train.trainer.run import loss_fn
from tests.distributed.conftest import run_rank_script
from tests.distributed.shared_launch import shared_out

pytestmark = pytest.mark.slow
K = 4
LLAMA = get_model_config("llama-debug")
# The gradient cases run one of them through Triton's interpreter, whose time grows with the
# elements packed: a narrower llama-debug (4 blocks, 32 neuron groups as before) keeps it short.
GRAD_OVERRIDES = {"dim": 64, "hidden_dim": 96}
GRAD_LLAMA = get_model_config("llama-debug", **GRAD_OVERRIDES)


def _masks() -> dict[str, np.ndarray]:
    # Blocks with coverage 2 and 3, overlapping holder sets, every worker non-empty.
    block = np.array([[1, 1, 0, 0], [1, 0, 1, 1], [0, 1, 1, 0], [0, 1, 0, 1]], dtype=np.uint8)
    rng = np.random.default_rng(7)
    neuron = np.zeros((K, block_map(GRAD_LLAMA).num_blocks("neuron")), dtype=np.uint8)
    for j in range(neuron.shape[1]):
        neuron[rng.choice(K, size=rng.integers(1, K + 1), replace=False), j] = 1
    neuron[:, 5] = 0
    neuron[2, 5] = 1  # a single-holder group: averaged over one worker, nothing sent
    return {"block": block, "neuron": neuron}


CASES = [("bsdp", "block"), ("nsdp", "neuron"), ("bbsdp", "block")]


@pytest.fixture(scope="module")
def grad_runs(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("grads")
    masks = _masks()
    cases = []
    for mode, level in CASES:
        path = save_mask(Mask(masks[level]), out / f"{mode}.json")
        # The fused Triton kernels (interpreted on CPU: slow, so for one case) do B-SDP's packing
        # inside real collectives; the others use the PyTorch reference. tests/kernels checks the
        # kernels against the reference on every segment kind, N-SDP's sliced ones included.
        backend = "triton" if mode == "bsdp" else "reference"
        cases.append({"model": "llama-debug", "model_overrides": GRAD_OVERRIDES, "mode": mode, "mask": str(path),
                      "backend": backend})
    run_rank_script(K, "grads", {"cases": cases}, out, interpret_triton=True)
    return out, masks


def _full(local: torch.Tensor, index: tuple, full_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter a local tensor into full coordinates; also return the indicator of held entries."""
    dim, idx, _ = index
    full, held = torch.zeros(full_shape), torch.zeros(full_shape)
    if dim is None:
        return local.clone(), torch.ones(full_shape)
    full.index_copy_(dim, torch.tensor(idx), local)
    held.index_fill_(dim, torch.tensor(idx), 1.0)
    return full, held


def _reference_average(mode: str, level: str, mask: np.ndarray, batches) -> dict[str, torch.Tensor]:
    """Average over holders of each worker's own gradient, in full-model coordinates."""
    shapes = block_map(GRAD_LLAMA).shapes
    total = {n: torch.zeros(s) for n, s in shapes.items()}
    count = {n: torch.zeros(s) for n, s in shapes.items()}
    for k in range(K):
        inputs, targets = batches[k]
        if mode == "bbsdp":
            model = build_model(GRAD_LLAMA, seed=0)
            held = held_tensors(GRAD_LLAMA, mask[k], level)  # what B-SDP worker k holds = what Bb-SDP trains
            index = {n: (None, [], 0) for n in held}
        else:
            model = build_worker_model(GRAD_LLAMA, mask[k], level, seed=0)
            index = {n: (s.dim, list(s.index), s.full_size) for n, s in model.full_index().items()}
        loss_fn(model(inputs), targets).backward()
        for name, p in model.named_parameters():
            if name not in index:
                continue  # Bb-SDP: frozen block, no gradient is averaged
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            full, held = _full(g, index[name], shapes[name])
            total[name] += full
            count[name] += held
    return {n: total[n] / count[n].clamp(min=1) for n in shapes}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_averaged_gradient_equals_holder_average_of_single_process_reference(grad_runs, case):
    out, masks = grad_runs
    mode, level = CASES[case]
    ranks = [torch.load(out / f"grads{case}_rank{r}.pt", weights_only=True) for r in range(K)]
    reference = _reference_average(mode, level, masks[level], [(r["inputs"], r["targets"]) for r in ranks])
    shapes = block_map(GRAD_LLAMA).shapes
    checked = 0
    for r, result in enumerate(ranks):
        held = held_tensors(GRAD_LLAMA, masks[level][r], level)
        for name, grad in result["grads"].items():
            if name not in held:
                continue
            dim, idx, _ = result["index"][name]
            expected = reference[name] if dim is None else reference[name].index_select(dim, torch.tensor(idx))
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=f"rank {r}, {name}")
            checked += 1
    assert checked > 0
    # The clipping norm: each averaged entry counted once across ranks.
    held_any = {n: torch.zeros(shapes[n]) for n in shapes}
    for r in range(K):
        for name, spec in held_tensors(GRAD_LLAMA, masks[level][r], level).items():
            held_any[name] = torch.maximum(held_any[name], _full(torch.ones(0), (None, [], 0), shapes[name])[1]
                                           if spec.is_whole else _full(torch.ones(spec.take(torch.ones(shapes[name])).shape),
                                                                       (spec.dim, list(spec.index), 0), shapes[name])[1])
    expected_sq = sum(float((reference[n] ** 2 * held_any[n]).sum()) for n in shapes if n in reference)
    assert float(sum(r["sq_norm"] for r in ranks)) == pytest.approx(expected_sq, rel=1e-5)


@pytest.mark.parametrize("case", [0, 2])
def test_comm_bytes_are_the_held_blocks_with_several_holders(grad_runs, case):
    out, masks = grad_runs
    mode, level = CASES[case]
    bmap = block_map(GRAD_LLAMA)
    mask = masks[level]
    shared = sum(int(np.prod(bmap.shapes[n])) for n in bmap.shared(level) if n in bmap.parameter_names)
    block_numel = [sum(int(np.prod(bmap.shapes[n])) for n, _ in bmap.owned(level, j)) for j in range(mask.shape[1])]
    for r in range(K):
        result = torch.load(out / f"grads{case}_rank{r}.pt", weights_only=True)
        held = [j for j in range(mask.shape[1]) if mask[r, j] and mask[:, j].sum() > 1]
        assert result["comm_bytes"] == 4 * (shared + sum(block_numel[j] for j in held)), f"rank {r}"
        # ring all-reduce among c holders: 2 (c - 1) / c of each bucket per rank
        expected_wire = sum(2 * (len(h) - 1) / len(h) * n for h, n in result["buckets"])
        assert result["wire_bytes"] == pytest.approx(expected_wire), f"rank {r}"
        assert expected_wire < result["comm_bytes"] * 2 * (K - 1) / K  # some buckets have fewer than K holders


RESNET_OVERRIDES = {"width_multiplier": 0.125, "in_channels": 1}
RESNET = get_model_config("resnet18-cifar", **RESNET_OVERRIDES)
RESNET_MASKS = {  # coverage 1 to 4 per block (channel group), every worker non-empty; the blocks
    # are layer1.0 ... layer4.1, with the downsampling ones (layer2.0, 3.0, 4.0) dropped on some workers
    "block": np.array([[1, 1, 0, 1, 1, 0, 1, 1], [1, 0, 1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0, 0, 1],
                       [0, 0, 0, 1, 1, 1, 0, 1]], dtype=np.uint8),
    "neuron": np.tile(np.array([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 0], [0, 0, 0, 1]], dtype=np.uint8), (1, 8)),
}
STEP_CASES = ["llama-bbsdp", "llama-fsdp", "resnet-bsdp", "resnet-nsdp", "resnet-bbsdp"]


def steps_spec(out: Path) -> tuple[str, dict]:
    """Two optimizer steps of every STEP_CASES run on K gloo ranks (in the shared launch
    `tests.distributed.shared_launch`); the masks written into `out`."""
    cases = [{"model": "llama-debug", "mode": "bbsdp", "mask": str(save_mask(Mask(_masks()["block"]), out / "b.json"))},
             {"model": "llama-debug", "mode": "fsdp"}]
    for mode, level in (("bsdp", "block"), ("nsdp", "neuron"), ("bbsdp", "block")):
        cases.append({"model": "resnet18-cifar", "model_overrides": RESNET_OVERRIDES, "mode": mode,
                      "mask": str(save_mask(Mask(RESNET_MASKS[level]), out / f"resnet-{mode}.json"))})
    return "steps", {"steps": 2, "cases": cases}


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory) -> list[list[dict]]:
    out = shared_out(tmp_path_factory, "test_sdp_training:steps_spec")
    return [[torch.load(out / f"steps{i}_rank{r}.pt", weights_only=True) for r in range(K)]
            for i in range(len(STEP_CASES))]


def test_bbsdp_every_rank_has_bit_identical_full_parameters_after_steps(step_runs):
    """Bb-SDP broadcasts each block's new values from a holder: after a step, all full models agree."""
    ranks = step_runs[STEP_CASES.index("llama-bbsdp")]
    names = set(block_map(LLAMA).parameter_names)
    assert set(ranks[0]["final"]) >= names
    for name in sorted(names):
        assert not torch.equal(ranks[0]["final"][name], ranks[0]["initial"][name]), f"{name} was not trained"
        for r in range(1, K):
            assert torch.equal(ranks[r]["final"][name], ranks[0]["final"][name]), f"rank {r} differs in {name}"


def test_fsdp_bytes_are_counted_on_the_first_step_only_and_wire_is_the_ring_share(step_runs):
    """FSDP's dispatch-mode byte counter must not tax later steps; with K ranks all-gather and
    reduce-scatter send (K - 1) / K of their buffers, the stats all-reduce 2 (K - 1) / K."""
    for r, result in enumerate(step_runs[STEP_CASES.index("llama-fsdp")]):
        steps = result["steps"]
        assert steps[0]["intercepted"] > 0 and [s["intercepted"] for s in steps[1:]] == [0], f"rank {r}"
        assert len({s["comm_bytes"] for s in steps}) == 1
        stats = 8
        for s in steps:
            expected = (K - 1) / K * (s["comm_bytes"] - stats) + 2 * (K - 1) / K * stats
            assert s["wire_bytes"] == pytest.approx(expected), f"rank {r}"


@pytest.mark.parametrize("case", ["resnet-bsdp", "resnet-nsdp", "resnet-bbsdp"])
def test_batchnorm_statistics_are_identical_among_the_holders_of_every_entry(step_runs, case):
    """Running statistics are averaged among the holders of each block (channel): after steps on
    different batches every entry is bit-identical on all the ranks that hold it."""
    mode = case.split("-")[1]
    level = "neuron" if mode == "nsdp" else "block"
    ranks = step_runs[STEP_CASES.index(case)]
    held = [held_tensors(RESNET, RESNET_MASKS[level][r], level) for r in range(K)]
    compared = moved = 0
    for name in block_map(RESNET).shapes:
        if not name.endswith(("running_mean", "running_var")):
            continue
        values: dict[int, list[torch.Tensor]] = {}  # full position -> each holder's value
        for r in range(K):
            if name not in held[r]:
                continue
            value, spec = ranks[r]["final"][name], held[r][name]
            moved += int(not torch.equal(value, ranks[r]["initial"][name]))
            for local, i in enumerate(range(value.shape[0]) if spec.is_whole else spec.index):
                values.setdefault(i, []).append(value[local])
        for i, vs in values.items():
            for v in vs[1:]:
                assert torch.equal(v, vs[0]), f"{mode}: {name}[{i}] differs among its holders"
                compared += 1
    assert compared > 0 and moved > 0


def _train_cfg(out: Path, **kw) -> dict:
    base = {"model": "llama-debug", "workers": 2, "steps": 6, "batch_size": 4, "seq_len": 32,
            "warmup_steps": 2, "lr": 3e-3, "eval_batches": 2, "max_data_bytes": 200_000, "seed": 1,
            "memory_steps": 0, "save_model": False}  # metrics only: no tracked step, no model file
    return {**base, **kw, "out": str(out)}


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _train_runs(out: Path) -> dict[str, dict]:
    resnet = {"model": "resnet18-cifar", "model_overrides": {"width_multiplier": 0.125}, "batch_size": 16,
              "lr": 1e-2, "steps": 8}
    runs = {
        "ddp": _train_cfg(out / "ddp", mode="ddp"),
        "complete": _train_cfg(out / "complete", mode="bsdp", mask=str(out / "complete.json"), active=None),
        "bsdp": _train_cfg(out / "bsdp", mode="bsdp", active=0.5),
        "nsdp": _train_cfg(out / "nsdp", mode="nsdp", active=0.5),
        "bbsdp": _train_cfg(out / "bbsdp", mode="bbsdp", active=0.5),
    }
    for mode in ("ddp", "bsdp", "nsdp", "bbsdp"):
        runs[f"resnet-{mode}"] = _train_cfg(out / f"resnet-{mode}", mode=mode, active=0.5, **resnet)
    return runs


def train_spec(out: Path) -> tuple[str, dict]:
    """The short runs on 2 gloo ranks (in the shared launch `tests.distributed.shared_launch`)."""
    save_mask(complete(2, 4), out / "complete.json")
    return "train", {"configs": list(_train_runs(out).values())}


def test_complete_mask_trajectory_equals_ddp_and_short_runs_lower_the_loss(tmp_path_factory):
    tmp_path = shared_out(tmp_path_factory, "test_sdp_training:train_spec")
    runs = _train_runs(tmp_path)
    ddp, sdp = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "complete")
    np.testing.assert_allclose([m["loss"] for m in sdp], [m["loss"] for m in ddp], rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in sdp], [m["grad_norm"] for m in ddp], rtol=1e-4)
    n_params = sum(p.numel() for p in build_model(LLAMA, seed=0).parameters())
    stats_bytes = 8  # the per-step [loss, grad-norm^2] all-reduce
    assert {m["comm_bytes"] for m in ddp} == {4 * n_params + stats_bytes}
    assert {m["comm_bytes"] for m in sdp} == {4 * n_params + stats_bytes}
    for name in runs:
        losses = [m["loss"] for m in _metrics(tmp_path / name)]
        assert np.mean(losses[-2:]) < losses[0], f"{name}: {losses}"
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert np.isfinite(summary["final_val_loss"])
        assert summary["config"]["mode"] == runs[name]["mode"]
