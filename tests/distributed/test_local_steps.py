"""Forward-masked overlap averaging (`SubnetworkDataParallel(..., local_steps=H)`) on 3 real gloo
ranks through the public API.

Each worker trains its own subnetwork with its own AdamW for H steps, sending nothing during
backward; then every held tensor (a block's, a neuron group's rows and columns, a shared one)
becomes its holders' average. Checked against a single-process reference of K model copies, each
with its own AdamW, that does exactly that: at block level with a static mask and with a
``permute`` schedule (at a change a gained block takes the values and AdamW state of its
lowest-ranked old holder, which right after an average hold the holders' mean), at neuron level
with a static mask. Also: bytes are sent only at averages, the gradient norm is the worker's
own (torch's clipping is then right and draws no warning), and a run stopped in the middle of an
averaging round resumes bit for bit. Run as a script, this file is the ranks' program."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from masklab import Mask, Schedule
from tests.distributed.mlp_net import HIDDEN, batch, make_net

pytestmark = pytest.mark.slow
K, STEPS, LR, H, STOP = 3, 6, 1e-2, 2, 2  # STOP: the resumed run saves after step 2, in the middle of a round
BASE = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
CASES = {
    "static": Mask(BASE),
    "permute": Mask(BASE, schedule=Schedule("permute", every=2 * H)),
    "neurons": Mask(np.hstack([BASE, np.roll(BASE, 1, axis=0), BASE])),  # 3 blocks x 3 neuron groups
    "static-bf16": Mask(BASE),  # comm_dtype=bfloat16 is for gradients: parameters still average in float32
}
SEED, GROUPS = 4, 3


def _wrapped(case: str):
    from sdp_train import MLPSpec, SubnetworkDataParallel

    kw = dict(level="neuron", neuron_groups=GROUPS, mlp=MLPSpec(("up",), "down")) if case == "neurons" else {}
    if case == "static-bf16":
        kw["comm_dtype"] = torch.bfloat16
    model = SubnetworkDataParallel(make_net(), mask=CASES[case], seed=SEED, local_steps=H, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model.register_optimizer(opt)  # counts the steps: averages after every H-th
    return model, opt


def _train(model, opt, rank: int, steps: range) -> list[dict]:
    trace = []
    for step in steps:
        x, y = batch(step, rank)
        before = model.comm_bytes
        (model(x) - y).square().mean().backward()
        sent_in_backward = model.comm_bytes - before
        own = torch.stack([p.grad.pow(2).sum() for p in model.module.parameters() if p.grad is not None]).sum().sqrt()
        norm = model.grad_norm()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # right here: every worker's own
        opt.step()
        opt.zero_grad()
        names = {id(p): n for n, p in model.module.named_parameters()}
        trace.append({"params": {n: t.clone() for n, t in model.module.state_dict().items()},
                      "state": {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items() if s},
                      "index": dict(model.local_index), "sent_in_backward": sent_in_backward,
                      "sent": model.comm_bytes, "norm": (float(norm), float(own)),
                      "warnings": [str(w.message) for w in caught]})
    return trace


def rank_work(out: Path) -> None:
    """What each rank runs and saves into `out`, in a process group that exists."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for case in CASES:
        model, opt = _wrapped(case)
        torch.save(_train(model, opt, rank, range(STEPS)), out / f"{case}{rank}.pt")
        model.close()
    model, opt = _wrapped("permute")
    _train(model, opt, rank, range(STOP + 1))
    full = model.full_state_dict()  # in the middle of a round: the holders' average, on copies
    if rank == 0:
        torch.save(full, out / "full_mid_round.pt")
    saved = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "schedule": model.schedule_state()}
    model.close()
    model, opt = _wrapped("permute")
    model.load_schedule_state(saved["schedule"])
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    torch.save(_train(model, opt, rank, range(STOP + 1, STEPS)), out / f"resumed{rank}.pt")
    model.close()

@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from tests.distributed.shared_launch import shared_out

    return shared_out(tmp_path_factory, "test_local_steps")


def _load(out: Path, prefix: str) -> list[list[dict]]:
    return [torch.load(out / f"{prefix}{r}.pt", weights_only=False) for r in range(K)]


def _holder_masks(name: str, matrix: np.ndarray, neurons: bool) -> list[torch.Tensor] | None:
    """Per worker, the 0/1 weight of each entry of `name` it holds (None: held whole by all)."""
    if not name.startswith("layers."):
        return None
    j = int(name.split(".")[1])
    if not neurons:
        return [torch.tensor(float(matrix[k, j])) for k in range(K)]
    if not (".up." in name or name.endswith("down.weight")):
        return None  # down.bias: every worker holds it whole
    per_neuron = [torch.tensor(np.repeat(matrix[k, j * GROUPS:(j + 1) * GROUPS], HIDDEN // GROUPS), dtype=torch.float32)
                  for k in range(K)]
    if name.endswith("down.weight"):
        return [m.view(1, -1) for m in per_neuron]
    return [m.view(-1, 1) if name.endswith("weight") else m for m in per_neuron]


def reference(case: str) -> list[list[dict]]:
    """K copies, K AdamWs; worker k steps the tensors it holds on its batch; every H steps each held
    entry becomes its holders' mean; at a change a gained block takes its lowest-ranked old holder's
    values and AdamW state."""
    mask, neurons = CASES[case], case == "neurons"
    copies = [make_net() for _ in range(K)]
    opts = [torch.optim.AdamW(c.parameters(), lr=LR, weight_decay=0.1) for c in copies]
    traces: list[list[dict]] = [[] for _ in range(K)]
    for step in range(STEPS):
        matrix = mask.round_matrix(step, seed=SEED).astype(bool)
        for k, (net, opt) in enumerate(zip(copies, opts)):
            opt.zero_grad(set_to_none=True)
            x, y = batch(step, k)
            if neurons:
                keep = [torch.tensor(np.repeat(matrix[k].reshape(3, GROUPS)[j], HIDDEN // GROUPS), dtype=torch.float32)
                        for j in range(3)]
                (net(x, keep=keep) - y).square().mean().backward()
            else:
                (net(x, held=matrix[k]) - y).square().mean().backward()
            opt.step()  # the blocks a worker does not hold have no gradient: AdamW skips them
        if (step + 1) % H == 0:
            with torch.no_grad():
                for name, _ in copies[0].named_parameters():
                    weights = _holder_masks(name, matrix, neurons) or [torch.tensor(1.0)] * K
                    params = [dict(c.named_parameters())[name] for c in copies]
                    total = sum(w * p for w, p in zip(weights, params))
                    count = sum(w.expand_as(params[0]) for w in weights)
                    mean = total / torch.where(count > 0, count, torch.ones_like(count))
                    for w, p in zip(weights, params):
                        p.copy_(torch.where(w.expand_as(p) > 0, mean, p))
        new = mask.round_matrix(step + 1, seed=SEED).astype(bool)
        for j in range(3):  # a gained block: values and state from the lowest-ranked old holder
            source = int(np.flatnonzero(matrix[:, j])[0])
            for k in np.flatnonzero(new[:, j] & ~matrix[:, j]):
                with torch.no_grad():
                    for (name, p), q in zip(copies[k].named_parameters(), copies[source].parameters()):
                        if name.startswith(f"layers.{j}."):
                            p.copy_(q)
                            opts[k].state[p] = {key: v.clone() for key, v in opts[source].state[q].items()}
        for k in range(K):
            names = {p: n for n, p in copies[k].named_parameters()}
            traces[k].append({"params": {n: t.clone() for n, t in copies[k].state_dict().items()},
                              "state": {names[p]: {key: v.clone() for key, v in s.items()}
                                        for p, s in opts[k].state.items()}})
    return traces


@pytest.mark.parametrize("case", list(CASES))
def test_each_worker_equals_its_reference_copy_at_every_step(out, case):
    ranks, ref = _load(out, case), reference(case)
    for step in range(STEPS):
        for k in range(K):
            snap = ranks[k][step]
            for name, local in snap["params"].items():
                take = snap["index"][name].take
                torch.testing.assert_close(local, take(ref[k][step]["params"][name]), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{case} step {step} rank {k} {name}: {m}")
                for key in ("exp_avg", "exp_avg_sq"):
                    if name in snap["state"]:
                        torch.testing.assert_close(snap["state"][name][key], take(ref[k][step]["state"][name][key]),
                                                   rtol=1e-5, atol=1e-7, msg=lambda m: f"{case} {step} {k} {name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_holders_agree_bit_for_bit_after_each_average_and_not_before(out, case):
    ranks = _load(out, case)
    shared = "head.weight"  # held whole by every worker
    for step in range(STEPS):
        values = [ranks[k][step]["params"][shared] for k in range(K)]
        agree = all(torch.equal(values[0], v) for v in values[1:])
        assert agree == ((step + 1) % H == 0), (case, step)


def test_nothing_is_sent_during_backward_and_bytes_fall_like_one_over_h(out):
    ranks = _load(out, "static")
    for k in range(K):
        assert all(s["sent_in_backward"] == 0 for s in ranks[k])
        sent = [s["sent"] for s in ranks[k]]
        assert sent[0] == 0 and sent[1] > 0 and sent[2] == sent[1] and sent[3] == 2 * sent[1]


@pytest.mark.parametrize("case", list(CASES))
def test_the_gradient_norm_is_the_workers_own_and_torch_clipping_draws_no_warning(out, case):
    for trace in _load(out, case):
        for snap in trace:
            assert snap["norm"][0] == pytest.approx(snap["norm"][1], rel=1e-6)
            assert not [w for w in snap["warnings"] if "clip" in w], snap["warnings"]


def test_the_full_model_in_the_middle_of_a_round_is_the_holders_average(out):
    ref = reference("permute")
    matrix = CASES["permute"].round_matrix(STOP, seed=SEED)
    full = torch.load(out / "full_mid_round.pt", weights_only=True)
    for name, value in full.items():
        j = int(name.split(".")[1]) if name.startswith("layers.") else None
        holders = range(K) if j is None else np.flatnonzero(matrix[:, j])
        expected = sum(ref[k][STOP]["params"][name] for k in holders) / len(holders)
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_run_stopped_mid_round_resumes_bit_for_bit(out):
    whole, resumed = _load(out, "permute"), _load(out, "resumed")
    for k in range(K):
        for snap, ref in zip(resumed[k], whole[k][STOP + 1:], strict=True):
            assert snap["params"].keys() == ref["params"].keys()
            for name, value in ref["params"].items():
                assert torch.equal(snap["params"][name], value), (k, name)


if __name__ == "__main__":
    from tests.distributed.shared_launch import run_alone

    run_alone(rank_work, sys.argv[1])
