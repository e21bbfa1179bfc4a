"""Run under torchrun by the distributed tests (alone, or in a shared launch: `shared_launch.py`):
real gloo process groups, one process per rank.

    python -m torch.distributed.run --standalone --nproc-per-node K rank_script.py CASE SPEC.json OUTDIR

``grads``: for each (model, mode, mask) in SPEC, one forward/backward on this rank's batch, the
sync engine's averaged gradients saved with the batch (full-model names, this rank's local
tensors and their full-model index) for the test to compare with a single-process reference.
``steps``: a few optimizer steps of each (model, mode, mask) case; every rank saves its state dict
and each step's bytes.
``eval_memory``: one step of each config in SPEC, then the validation under the memory tracker.
``overlap``: one backward per case, logging the order of gradient events and all_reduce launches,
and saving the loss and the averaged gradients (a case may ``compile`` its blocks with a backend).
``train``: the training loop for each config in SPEC, one after another in one process group.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sdp_train.data import build_batches
from sdp_train.parallel.dist import default_device, get_dist_info
from sdp_train.trainer.config import TrainConfig
from sdp_train.trainer.launch import destroy_distributed, init_distributed
from sdp_train.trainer.prepare import prepare
from sdp_train.trainer.run import Run, loss_fn
from sdp_train.trainer.train import modules_before_groups, train_prepared


def grads_case(spec: dict, info, device, out: Path) -> None:
    for i, case in enumerate(spec["cases"]):
        cfg = TrainConfig(model=case["model"], mode=case["mode"], workers=info.world_size, batch_size=2,
                          seq_len=16, active=None, mask=case["mask"], out=str(out),
                          model_overrides=case.get("model_overrides", {}))
        prep = prepare(cfg)
        run = Run(prep, info, device)
        run.sync.engine.backend = case["backend"]  # "triton" fails unless the Triton kernels really run
        inputs, targets = next(build_batches(prep.data, split="train", seed=0, rank=info.rank,
                                             world_size=info.world_size))
        before, wire_before = run.comm_bytes, run.wire_bytes
        loss_fn(run.train_model(inputs), targets).backward()
        sq_norm = run.sync.grad_sq_norm()  # the API finished the averaging when backward ended
        torch.save({
            "inputs": inputs, "targets": targets, "sq_norm": sq_norm,
            "grads": {n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None},
            "index": {n: (s.dim, list(s.index), s.full_size) for n, s in run.model.full_index().items()},
            "comm_bytes": run.comm_bytes - before, "wire_bytes": run.wire_bytes - wire_before,
            "buckets": [(list(b.plan.holders), b.buffer.numel() * b.buffer.element_size()) for b in run.sync.engine.buckets],
        }, out / f"grads{i}_rank{info.rank}.pt")


def steps_case(spec: dict, info, device, out: Path) -> None:
    """`spec["steps"]` optimizer steps of each case; every rank saves its state dict before and after
    them, and per step its buffer and wire bytes and the ops FSDP's byte counter intercepted."""
    import sdp_train.trainer.modes as modes_module

    calls = [0]
    original = modes_module.FSDPCollectiveBytes.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    modes_module.FSDPCollectiveBytes.__torch_dispatch__ = counted
    for i, case in enumerate(spec["cases"]):
        cfg = TrainConfig(model=case["model"], mode=case["mode"], workers=info.world_size, batch_size=2,
                          seq_len=16, active=None, mask=case.get("mask"), out=str(out), warmup_steps=1,
                          model_overrides=case.get("model_overrides", {}))
        prep = prepare(cfg)
        run = Run(prep, info, device)
        initial = {n: t.clone() for n, t in run.model.state_dict().items()}
        batches = build_batches(prep.data, split="train", seed=0, rank=info.rank, world_size=info.world_size)
        steps = []
        for step in range(spec["steps"]):
            inputs, targets = next(batches)
            before = (run.comm_bytes, run.wire_bytes, calls[0])
            run.step(step, inputs, targets)
            steps.append({"comm_bytes": run.comm_bytes - before[0], "wire_bytes": run.wire_bytes - before[1],
                          "intercepted": calls[0] - before[2]})
        sharded = cfg.mode == "fsdp"  # its states are shards: only the bytes are compared
        torch.save({"initial": {} if sharded else initial, "final": {} if sharded else run.model.state_dict(),
                    "steps": steps}, out / f"steps{i}_rank{info.rank}.pt")
        del run
        gc.collect()


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and alive together (weakref-tracked)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen and key not in inputs:  # views and in-place results: not new
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def eval_memory_case(spec: dict, info, device, out: Path) -> None:
    """One step of each config, then `evaluate` tracking the bytes it allocates; saves them and the val loss."""
    from sdp_train.trainer.train import evaluate

    for i, cfg_dict in enumerate(spec["configs"]):
        prep = prepare(TrainConfig(**cfg_dict))
        run = Run(prep, info, device)
        inputs, targets = next(build_batches(prep.data, split="train", seed=0, rank=info.rank,
                                             world_size=info.world_size))
        run.step(0, inputs, targets)
        tracker = LiveBytes()
        with tracker:
            val_loss, _ = evaluate(run, prep)  # (loss, accuracy): the accuracy is None on text
        (out / f"eval{i}_rank{info.rank}.json").write_text(json.dumps({"peak": tracker.peak, "val_loss": val_loss}))


def overlap_case(spec: dict, info, device, out: Path) -> None:
    """One backward of each case, logging in order every gradient the engine sees and every all_reduce it
    launches; its loss and averaged gradients saved."""
    from sdp_train.parallel import sync

    events: list[str] = []
    on_grad, all_reduce = sync.SyncEngine._on_grad, sync.dist.all_reduce

    def logged_on_grad(self, param):
        events.append("grad")
        return on_grad(self, param)

    def logged_all_reduce(tensor, *args, **kwargs):
        events.append("launch")
        return all_reduce(tensor, *args, **kwargs)

    sync.SyncEngine._on_grad, sync.dist.all_reduce = logged_on_grad, logged_all_reduce
    for i, case in enumerate(spec["cases"]):
        prep = prepare(TrainConfig(model="llama-debug", mode=case["mode"], workers=info.world_size, batch_size=2,
                                   seq_len=16, active=0.5, out=str(out), compile=case.get("compile")))
        run = Run(prep, info, device)
        inputs, targets = next(build_batches(prep.data, split="train", seed=0, rank=info.rank,
                                             world_size=info.world_size))
        events.clear()
        loss = loss_fn(run.train_model(inputs), targets)
        loss.backward()
        backward_events = list(events)  # the API finishes the averaging before backward returns
        (out / f"overlap{i}_rank{info.rank}.json").write_text(json.dumps(backward_events))
        graphs = sys.modules["torch._dynamo.utils"].counters["stats"]["unique_graphs"] if case.get("compile") else 0
        grads = {n: p.grad for n, p in run.model.named_parameters() if p.grad is not None}
        torch.save({"loss": loss.detach(), "graphs": graphs, "grads": grads}, out / f"overlap{i}_rank{info.rank}.pt")


def train_case(spec: dict, info, device, out: Path) -> None:
    for cfg_dict in spec["configs"]:
        train_prepared(prepare(TrainConfig(**cfg_dict)), info, device)
        gc.collect()  # free the previous run's DDP reducer before the next run's collectives
        torch.distributed.barrier()


def preload(case: str, spec: dict) -> tuple[str, ...]:
    """What this case's runs import that must precede the process group (`modules_before_groups`)."""
    if case == "train":
        return modules_before_groups([TrainConfig(**c) for c in spec["configs"]], default_device())
    fsdp = any(c.get("mode") == "fsdp" or c.get("fsdp") for c in spec.get("cases", spec.get("configs", [])))
    return ("torch.distributed.tensor",) if fsdp else ()


CASES = {"grads": grads_case, "steps": steps_case, "eval_memory": eval_memory_case, "overlap": overlap_case,
         "train": train_case}


def run_case(case: str, spec: dict, out: Path) -> None:
    """`case` of `spec` into `out` in the process group that exists (a shared launch's,
    `tests.distributed.shared_launch`); its `preload` modules imported before the group."""
    out.mkdir(parents=True, exist_ok=True)
    CASES[case](spec, get_dist_info(), default_device(), out)


def main() -> None:
    case, spec_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    device = default_device()
    info = init_distributed(device, preload=preload(case, spec))
    try:
        CASES[case](spec, info, device, out)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
