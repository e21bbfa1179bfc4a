"""``sdp eval``: a run's model on downstream tasks with lm-eval's Hugging Face backend (docs/eval.md).

Parses, calls `sdp_train.integrations.lm_eval.evaluate` (which converts an ``sdp train`` run of a
built-in LLaMA into a Hugging Face model first) and prints each task's accuracies. lm-eval is the
optional ``eval`` extra: without it the command refuses in one line before anything is converted.
"""

from __future__ import annotations

import argparse
import json

from sdp_train.integrations.lm_eval import INSTALL, PAPER_TASKS, evaluate


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help="score a run's model on the paper's downstream tasks with lm-eval",
        description="Evaluate a model zero-shot on lm-eval tasks with lm-eval's Hugging Face (hf) backend and print "
                    "each task's accuracy (acc) and length-normalised accuracy (acc_norm) with their standard errors. "
                    "DIR is a Hugging Face causal LM directory (config.json), used as it is, or the --out of an sdp "
                    f"train run of a built-in LLaMA, converted into one first. Default tasks: the SDP paper's "
                    f"{', '.join(PAPER_TASKS)} (ARC-Easy, BoolQ, HellaSwag, OpenBookQA, SciQ), whose datasets "
                    f"lm-eval downloads; tasks of your own in local files run offline (--include-path). Needs the "
                    f"eval extra: {INSTALL}.")
    p.add_argument("model_dir", metavar="DIR", help="a Hugging Face model directory, or an sdp train --out directory")
    p.add_argument("--tasks", default=",".join(PAPER_TASKS), metavar="T1,T2",
                   help="comma-separated lm-eval task names (default: the paper's five)")
    p.add_argument("--include-path", default=None, metavar="DIR",
                   help="a directory of lm-eval task YAML files defining tasks of your own")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N documents of each task: a quick check, not a result")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward pass (default 8)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda, cuda:1, ... (default: cuda when there is one, else cpu)")
    p.add_argument("--tokenizer", default=None, metavar="bytes|DIR",
                   help="'bytes' (one id per byte) or a local Hugging Face tokenizer directory (default: the model "
                        "directory's own, else the one of the data the run trained on)")
    p.add_argument("--hf-out", default=None, metavar="DIR",
                   help="keep the Hugging Face model converted from an sdp train run in this new directory "
                        "(default: a temporary one)")
    p.add_argument("--samples", default=None, metavar="FILE.jsonl",
                   help="also write every document scored, one JSON object a line: task, doc_id, target, responses "
                        "(for a multiple-choice task each choice's [log-likelihood, is greedy]) and its metrics")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object: task -> metric -> value")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    results = evaluate(args.model_dir, tasks, tokenizer=args.tokenizer, include_path=args.include_path,
                       limit=args.limit, batch_size=args.batch_size, device=args.device, hf_out=args.hf_out,
                       samples_out=args.samples)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for task, metrics in results.items():
        parts = [f"{name} {metrics[name]:.4f} ± {metrics.get(f'{name}_stderr', float('nan')):.4f}"
                 for name in ("acc", "acc_norm") if name in metrics]
        samples = f" ({metrics['samples']} documents)" if "samples" in metrics else ""
        print(f"{task}: {', '.join(parts) or 'no accuracy reported'}{samples}")
    if args.limit is not None:
        print(f"sdp eval: --limit {args.limit} scored only the first documents of each task: not a result to report")
    return 0
