"""The sync engine launches per run of buckets, not per bucket, and averages exactly as before.

On an N-SDP mask whose layers' MLP rows fall into several holder sets (so one gradient completes
several buckets), one backward of llama-debug on one process with recorded all-reduces: `finish`
unpacks every bucket with one launch, the buckets one gradient completes are packed with one
launch, each bucket's all-reduce still starts in the hook that completed it, and the averaged
gradients equal, bit for bit, a pack and unpack per bucket with the PyTorch reference (Triton
interpreted on CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels
from kernels import triton_ops
from sdp_train.models import block_map, get_model_config
from sdp_train.models.subnet import build_worker_model, held_tensors
from sdp_train.parallel import sync
from sdp_train.parallel.sync import SyncEngine, plan_buckets
from sdp_train.trainer.run import loss_fn

K = 4
LLAMA = get_model_config("llama-debug", dim=32, hidden_dim=48)


def _neuron_mask() -> np.ndarray:
    rng = np.random.default_rng(7)
    mask = np.zeros((K, block_map(LLAMA).num_blocks("neuron")), dtype=np.uint8)
    for j in range(mask.shape[1]):
        mask[rng.choice(K, size=rng.integers(1, K + 1), replace=False), j] = 1
    mask[:, 5] = 0
    mask[1, 5] = 1  # a single holder: averaged over one worker, nothing sent
    return mask


def _engine(rank: int, backend: str, monkeypatch, events: list):
    mask = _neuron_mask()
    held = [held_tensors(LLAMA, mask[k], "neuron") for k in range(K)]
    bmap = block_map(LLAMA)
    plans = plan_buckets(held, [n for n in bmap.shapes if n in bmap.parameter_names], shapes=bmap.shapes)
    model = build_worker_model(LLAMA, mask[rank], "neuron", seed=0)

    class Done:
        def wait(self) -> None:
            pass

    def all_reduce(buffer, group=None, async_op=False):  # one process: the holders' sum is this rank's buffer
        events.append(("all_reduce", buffer.data_ptr()))
        return Done()

    monkeypatch.setattr(sync.dist, "all_reduce", all_reduce)
    for name, p in model.named_parameters():  # registered before the engine's hooks: runs before them
        p.register_post_accumulate_grad_hook(lambda _, name=name: events.append(("grad", name)))
    groups = {p.holders: (object() if len(p.holders) > 1 else None) for p in plans}
    return model, SyncEngine(model, plans, model.full_index(), groups, rank, backend=backend)


def _backward(model, seed: int = 0) -> None:
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()


@pytest.mark.parametrize("rank", [0, 1])
def test_one_unpack_launch_per_finish_one_pack_launch_per_completing_gradient(monkeypatch, rank):
    launches: list = []
    monkeypatch.setattr(type(triton_ops._pack_kernel), "run",
                        lambda self, *a, grid, warmup, **k: launches.append(("launch", self.fn.__name__)))
    events = launches  # one timeline: gradients, launches, all-reduces
    model, engine = _engine(rank, "triton", monkeypatch, events)
    for _ in range(2):
        launches.clear()
        _backward(model)
        engine.finish()
        model.zero_grad()
        sending = [b for b in engine.buckets if b.communicates]
        assert len(sending) > 1
        assert [e for e in events if e == ("launch", "_unpack_kernel")] == [("launch", "_unpack_kernel")]
        # every gradient that completes some bucket packs them with one launch, then sends them in order
        completing = [i for i, e in enumerate(events) if e[0] == "grad"]
        packs = [i for i, e in enumerate(events) if e == ("launch", "_pack_kernel")]
        reduces = [e[1] for e in events if e[0] == "all_reduce"]
        assert reduces == [b.buffer.data_ptr() for b in sending]
        assert len(packs) < len(sending)
        for i in packs:
            assert events[i - 1][0] == "grad" or events[i - 1][0] == "all_reduce"
            assert events[i + 1][0] == "all_reduce"  # the pack's buckets are sent at once, in the same hook
        assert len(packs) <= len(completing)
    engine.remove_hooks()


def _per_bucket_reference(engine, grads: dict) -> tuple[dict, float]:
    """Today's launch per bucket, with the reference: pack scaled by 1/c_j, the one-process sum, unpack."""
    out = {p: g.clone() for p, g in grads.items()}
    norm = 0.0
    for bucket in engine.buckets:
        tensors = [out[p] for p in bucket.params]
        if bucket.communicates:
            buffer = kernels.pack(tensors, bucket.layout, scale=bucket.layout.inverse_coverage, backend="reference")
            kernels.unpack(buffer, tensors, bucket.layout, backend="reference")
        if bucket.plan.holders[0] == engine.rank:
            norm += float(kernels.squared_norm(tensors, bucket.layout, backend="reference"))
    return out, norm


def test_averaged_gradients_equal_a_pack_and_unpack_per_bucket_bit_for_bit(monkeypatch):
    # rank 1: buckets it counts in the norm and buckets another holder counts, and a single holder's
    model, engine = _engine(1, "triton", monkeypatch, [])
    assert any(not b.communicates for b in engine.buckets)
    assert {b.plan.holders[0] == 1 for b in engine.buckets if b.communicates} == {True, False}
    params = list(dict.fromkeys(p for b in engine.buckets for p in b.params))
    for step in range(2):  # the second step reuses every run's layout and launch plan
        _backward(model, seed=step)  # packed in the hooks, sent, unpacked by finish
        want, want_norm = _per_bucket_reference(engine, {p: p.grad for p in params})
        norm = engine.finish()
        assert all(torch.equal(p.grad, want[p]) for p in params)
        assert float(norm) == pytest.approx(want_norm, rel=1e-5)
        model.zero_grad()
    engine.remove_hooks()
