"""``sdp compare``: run (or resume) a named comparison of DDP, FSDP and the SDP variants."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from sdp_train.compare.runner import PRESETS

    p = subparsers.add_parser(
        "compare", help="design, verify, train DDP/FSDP/SDP side by side and report",
        description="Design and certify the masks, then train DDP, FSDP, FSDP+AC, B-SDP, N-SDP, Bb-SDP, "
                    "B-SDP+FSDP+AC, a FLOP-matched B-SDP, a sweep of C and a heterogeneous-data pair on the "
                    "same data, seeds and budget; write compare.json, compare.md and plots. "
                    "Re-running skips the runs that finished. With --seeds N every system is trained with "
                    "seeds 0..N-1 and the report adds mean, spread and 95% confidence intervals of every ratio "
                    "to DDP, and says which val-loss differences to DDP are larger than the seed-to-seed spread. "
                    "--preset cpu-overlap instead compares overlap averaging (static and permute masks, iid and "
                    "heterogeneous data, two masks of one coverage and different spectral gap) with DDP and "
                    "stepwise B-SDP/Bb-SDP, with the consensus distance beside Theorem 4. The image presets "
                    "(cifar10-resnet18, -wrn18, -swin-tiny, the same for cifar100, and the CPU smoke cpu-cifar) "
                    "train DDP and B-, N- and Bb-SDP at C = 3/8, 1/2, 3/4 on --data cifar:DIR and report "
                    "top-1 accuracy.")
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS), help="(default cpu-small)")
    p.add_argument("--out", default="runs/compare", metavar="DIR", help="(default runs/compare)")
    p.add_argument("--data", default=None, metavar="SOURCE",
                   help="data of every run, as in sdp train --data (default: the preset's, stdlib bytes; "
                        "the image presets need cifar:DIR)")
    p.add_argument("--seeds", default=1, type=int, metavar="N",
                   help="train every system with seeds 0..N-1 (same mask each seed; seed S > 0 in "
                        "DIR/runs/NAME/seed_S) and report the seed statistics (default 1: one seed, a smoke test)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sdp_train.compare.runner import compare

    out = Path(args.out)
    compare(args.preset, out, data=args.data, seeds=args.seeds)
    print()
    print((out / "compare.md").read_text(encoding="utf-8"))
    plots = [out / name for name in ("compare_loss.png", "compare_cost.png", "compare_consensus.png")
             if (out / name).is_file()]
    print(f"report: {out / 'compare.json'}; plots: {', '.join(map(str, plots))}")
    return 0
