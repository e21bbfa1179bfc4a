"""B-SDP of your own model in your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_custom_model.py --out /tmp/sdp-custom

Each rank builds the same model; SubnetworkDataParallel finds its ModuleList of residual blocks,
designs a mask in which every worker holds half of them (active=0.5), removes the others from
this worker, and averages every gradient among the workers that hold it during backward. The
optimizer, LR schedule, data and loss are the user's. See docs/api.md.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sdp_train import SubnetworkDataParallel


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Classifier(nn.Module):
    def __init__(self, inputs: int = 20, width: int = 64, depth: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):  # x: (batch, inputs) -> logits (batch, classes)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batches(rank: int, batch_size: int, seed: int = 0):
    """A synthetic task: the class is which quarter of the input's first two features' angle it is."""
    g = torch.Generator().manual_seed(seed + rank)
    while True:
        x = torch.randn(batch_size, 20, generator=g)
        angle = torch.atan2(x[:, 1], x[:, 0])
        yield x, ((angle + torch.pi) / (torch.pi / 2)).long().clamp(max=3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="sdp-custom-out")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun; without it, one process trains alone
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    try:
        train(args, dist.get_rank() if dist.is_initialized() else 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int) -> None:
    torch.manual_seed(0)
    model = SubnetworkDataParallel(Classifier(), active=0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    if rank == 0:
        print(f"mask (workers x blocks):\n{model.mask.matrix}\nthis worker holds {model.held_blocks}")

    data = batches(rank, batch_size=32)
    for step in range(args.steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # gradients are averaged among each block's holders when this returns
        model.clip_grad_norm_(1.0)  # counts every block once across workers
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    model.save_full(os.path.join(args.out, "model.safetensors"))  # every rank joins; rank 0 writes
    if rank == 0:
        from safetensors.torch import load_file

        full = Classifier()
        full.load_state_dict(load_file(os.path.join(args.out, "model.safetensors")))
        x, y = next(batches(rank=99, batch_size=512))
        accuracy = (full(x).argmax(-1) == y).float().mean().item()
        print(f"full model reloaded: validation accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
