"""What does holding each maskable block cost a B-SDP worker? A masklab costs file from sdp plan's model.

Block j's bytes are what a worker saves by not holding it: its parameters with their gradients,
AdamW's two moments and the sync engine's bucket copy (5 elements each, and AdamW's step per
tensor), its buffers, and the forward activations that the worker keeps with the block and not
without it (`sdp_train.plan_activations`: for a downsampling ResNet block, less the shortcut's
output that its pass-through keeps). The fixed bytes are the rest of a worker that holds every
block, so that fixed + the sum of the blocks' bytes is that worker. Backward's temporaries and the
optimizer's foreach buffer are left out: they come on top at the peak, whatever the mask. Feed
the file to ``sdp design --costs`` for a mask that balances bytes instead of block counts.

    python benchmarks/block_costs.py --model resnet18-cifar --batch-size 64 --image-size 32 \\
        --out costs.json
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from masklab import BlockCosts, save_costs
from sdp_train.models import block_map, get_model_config, model_class, subnet_kwargs
from sdp_train.plan_activations import activation_model

ELEM = 4  # float32, what sdp train runs
STATE_ELEMENTS = 5  # parameter, gradient, two AdamW moments, the sync engine's bucket copy
STEP_BYTES = 4  # AdamW's float32 step counter per tensor


def forward_bytes(config, row: np.ndarray, batch_size: int, seq_len: int, image_size: int) -> int:
    """Activation bytes kept at the end of forward by the worker holding the blocks of ``row``."""
    with torch.device("meta"):
        model = model_class(config)(config, **subnet_kwargs(config, row, "block"))
    acts = activation_model(model, frozenset(), batch_size=batch_size, seq_len=seq_len, image_size=image_size,
                            elem=ELEM)
    return acts.forward_bytes(ac=False)


def block_costs(config, *, batch_size: int, seq_len: int, image_size: int) -> BlockCosts:
    bmap = block_map(config)
    every = np.ones(bmap.num_blocks("block"), dtype=bool)
    full_acts = forward_bytes(config, every, batch_size, seq_len, image_size)
    costs = []
    for j, block in enumerate(bmap.blocks["block"]):
        names = [n for n, _ in block.tensors]
        params = [n for n in names if n in bmap.parameter_names]
        state = sum(STATE_ELEMENTS * ELEM * math.prod(bmap.shapes[n]) + STEP_BYTES for n in params)
        buffers = sum(ELEM * math.prod(bmap.shapes[n]) for n in names if n not in bmap.parameter_names)
        without = every.copy()
        without[j] = False
        costs.append(state + buffers + full_acts - forward_bytes(config, without, batch_size, seq_len, image_size))
    params = [n for n in bmap.shapes if n in bmap.parameter_names]
    total = sum(STATE_ELEMENTS * ELEM * math.prod(bmap.shapes[n]) + STEP_BYTES for n in params)
    total += sum(ELEM * math.prod(s) for n, s in bmap.shapes.items() if n not in bmap.parameter_names) + full_acts
    return BlockCosts(costs, block_names=bmap.block_names("block"), fixed_bytes=total - sum(costs),
                      source=f"benchmarks/block_costs.py {config.name} batch {batch_size} seq {seq_len} "
                             f"image {image_size} float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18-cifar")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    costs = block_costs(get_model_config(args.model), batch_size=args.batch_size, seq_len=args.seq_len,
                        image_size=args.image_size)
    save_costs(costs, args.out)
    for name, b in zip(costs.block_names, costs.block_bytes):
        print(f"{name:10s} {b / 2**20:8.1f} MiB")
    print(f"{'fixed':10s} {costs.fixed_bytes / 2**20:8.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
