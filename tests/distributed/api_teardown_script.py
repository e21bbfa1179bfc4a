"""Run under torchrun by test_teardown.py: a user's own loop with the library API, then list threads.

    python -m torch.distributed.run --standalone --nproc-per-node 2 api_teardown_script.py OUTDIR [ORDER]

ORDER is ``import-first`` (``sdp_train.parallel.wrapper`` imported before ``init_process_group``, as a script
importing at its top does) or ``init-first`` (the group exists before the API is imported); without
it, rank 0 imports first and rank 1 initialises first (the order is each process's own). The
loop drops half of the model's blocks (their pass-throughs probe the block's output on the meta
device, whose first operation imports ``torch._dynamo``), trains two steps, clips, saves the full
model, and calls ``dist.destroy_process_group()``, as the examples do. After it no gloo thread may
be alive: a group that outlives it is freed during interpreter shutdown, where its threads can
abort the finished process (``terminate called without an active exception``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def native_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def train(out: str) -> None:
    from sdp_train import SubnetworkDataParallel

    torch.manual_seed(0)
    model = SubnetworkDataParallel(Net(), active=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    model.save_full(os.path.join(out, "model.safetensors"))


def main(out: str, order: str | None = None) -> None:
    if order is None:
        order = ("import-first", "init-first")[int(os.environ["RANK"]) % 2]
    if order == "import-first":
        import sdp_train.parallel.wrapper  # noqa: F401
    elif order != "init-first":
        raise SystemExit(f"ORDER must be import-first or init-first, not {order!r}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        train(out)
    finally:
        dist.destroy_process_group()
    gc.collect()
    Path(out, f"threads_{order}_rank{rank}.json").write_text(json.dumps(native_threads()))


if __name__ == "__main__":
    main(*sys.argv[1:])
