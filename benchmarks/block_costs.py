"""What does holding each maskable block cost a B-SDP worker? A masklab costs file from sdp plan's model.

The numbers are `sdp_train.planning.costs.block_costs` (its docstring says what they count); ``sdp
plan --budgets SIZES --costs-out FILE`` writes the same file while it designs a mask for devices.
Backward's temporaries and the optimizer's foreach buffer are left out: they come on top at the
peak. Feed the file to ``sdp design --costs`` for a mask that balances bytes instead of block counts.

    python benchmarks/block_costs.py --model resnet18-cifar --batch-size 64 --image-size 32 \\
        --out costs.json
"""

from __future__ import annotations

import argparse

from masklab import save_costs
from sdp_train.planning.costs import block_costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18-cifar")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    costs = block_costs(args.model, batch_size=args.batch_size, seq_len=args.seq_len, image_size=args.image_size)
    save_costs(costs, args.out)
    for name, b in zip(costs.block_names, costs.block_bytes):
        print(f"{name:10s} {b / 2**20:8.1f} MiB")
    print(f"{'fixed':10s} {costs.fixed_bytes / 2**20:8.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
