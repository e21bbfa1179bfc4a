"""summary.md of a `scripts/gpu_check.sh` run: one page with every step's result.

    python scripts/gpu_check_summary.py OUT [--device cuda] [--model llama-134m]

Reads what the steps left in OUT (steps.tsv, kernel_tests.xml, bench_kernels.json, step_host.json,
sync_debug.txt, memory/*/summary.json, plan.json, plan_ac.json) and writes OUT/summary.md; a missing
or broken input becomes a line that says so, never an error. Exits 1 if no memory configuration
could be compared with `sdp plan`.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

SYSTEM_NAMES = {"ddp": "DDP", "fsdp": "FSDP", "bsdp": "B-SDP", "nsdp": "N-SDP", "bbsdp": "Bb-SDP", "ac": "AC"}


def system_name(config: str) -> str:
    """`sdp plan`'s name of a memory_ranks.py configuration: ``bsdp+fsdp+ac`` -> ``B-SDP+FSDP+AC``."""
    return "+".join(SYSTEM_NAMES[part] for part in config.split("+"))


def _json(path: Path):
    text = path.read_text()
    return json.loads(text[min(i for i in (text.find("["), text.find("{")) if i >= 0):])


def steps_section(out: Path) -> list[str]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    lines = ["## Steps", "", "| step | exit | seconds | limit s |", "|---|---|---:|---:|"]
    lines += [f"| {r[0]} | {'ok' if r[1] == '0' else 'FAILED ' + r[1]} | {r[2]} | {r[3]} |" for r in rows]
    return lines + ["", f"{sum(int(r[2]) for r in rows)} s so far, limits {sum(int(r[3]) for r in rows)} s."]


def kernels_section(out: Path) -> list[str]:
    lines = ["## Kernels: correctness and bandwidth against torch copies of the same bytes", ""]
    try:
        suite = ElementTree.parse(out / "kernel_tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        lines.append(f"tests/kernels on the device: {suite.get('tests')} tests, {suite.get('failures')} failures, "
                     f"{suite.get('errors')} errors, {suite.get('skipped')} skipped.")
    except (OSError, ElementTree.ParseError, IndexError) as exc:
        lines.append(f"kernel tests: no results ({type(exc).__name__})")
    try:
        rows = _json(out / "bench_kernels.json")
    except (OSError, ValueError) as exc:
        return lines + ["", f"bandwidth: no results ({type(exc).__name__})"]
    lines += ["", "| bucket and operation | method | GB/s useful | x plain copy | x best eager |", "|---|---|---:|---:|---:|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        eager = [r["seconds"] for r in mine if r["method"].startswith("eager")]
        for r in mine:
            if "fused Triton" in r["method"] or r["method"] == "kernels reference":
                vs_eager = f"{min(eager) / r['seconds']:.2f}" if eager else "-"
                lines.append(f"| {case.replace(' | ', ': ')} | {r['method']} | {r['useful_bytes'] / r['seconds'] / 1e9:.1f} | "
                             f"{r['copy_seconds'] / r['seconds']:.2f} | {vs_eager} |")
    return lines


def host_section(out: Path) -> list[str]:
    lines = ["## Sync engine host time per step (issue 29's target: <= 3 ms)", ""]
    try:
        result = _json(out / "step_host.json")
    except (OSError, ValueError) as exc:
        return lines + [f"no results ({type(exc).__name__})"]
    lines += [f"{result.get('model', '?')} bucket plan, {result['device']}; collectives not counted.", ""]
    ddp = result["ddp"]
    lines += ["| engine | buckets | launches per step | host ms per step | best ms | us per bucket | x DDP |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["sdp"]:
        lines.append(f"| {r['what']} | {r['buckets']} | {r['launches_per_step']:.0f} | {r['step_ms']:.2f} | "
                     f"{r['best_step_ms']:.2f} | {r['per_bucket_us']:.1f} | {r['step_ms'] / ddp['step_ms']:.2f} |")
    lines.append(f"| {ddp['what']} | {ddp['buckets']} | - | {ddp['step_ms']:.2f} | {ddp['best_step_ms']:.2f} | - | 1.00 |")
    return lines


def sync_section(out: Path) -> list[str]:
    lines = ["## Host synchronisation in steady-state steps", ""]
    try:
        found = [line for line in (out / "sync_debug.txt").read_text().splitlines() if ": " in line and
                 ("no host synchronisation" in line or "FAILED" in line)]
    except OSError:
        found = []
    return lines + ([f"- {line}" for line in found] or ["no results"])


def memory_section(out: Path, device: str, model: str) -> tuple[list[str], int]:
    lines = [f"## Peak memory per rank, 2 ranks sharing one device ({device}, {model}): measured vs `sdp plan`", "",
             "| config | measured MiB per rank | predicted MiB | measured / predicted |", "|---|---|---:|---:|"]
    plan = []
    for name in ("plan.json", "plan_ac.json"):
        try:
            plan += _json(out / name)
        except (OSError, ValueError):
            pass
    predicted = {r["system"]: max(r.get("per_rank") or [r["total"]]) - r["communicators"] for r in plan}
    compared = 0
    for summary in sorted(out.glob("memory/*/summary.json")):
        config = summary.parent.name
        peaks = [p.get("total", 0) for p in json.loads(summary.read_text())["peak_memory_bytes"]]
        want = predicted.get(system_name(config))
        shown = ", ".join(f"{p / 2**20:.1f}" for p in peaks)
        if want:
            compared += 1
            lines.append(f"| {config} | {shown} | {want / 2**20:.1f} | {max(peaks) / want:.2f} |")
        else:
            lines.append(f"| {config} | {shown} | no prediction | - |")
    missing = sorted({p.name.removeprefix("memory_").removesuffix(".txt") for p in out.glob("memory_*.txt")}
                     - {s.parent.name for s in out.glob("memory/*/summary.json")})
    lines += [f"| {config} | run failed (memory_{config}.txt) | - | - |" for config in missing]
    lines += ["", "Predicted: `sdp plan`'s largest rank less its communicators (gloo holds no NCCL buffers); "
                  "measured: `torch.cuda.max_memory_allocated` per rank (the CPU tracker on a dry run)."]
    return lines, compared


def build_summary(out: Path, device: str, model: str) -> tuple[str, int]:
    """The text of summary.md and the number of memory configurations compared with the plan."""
    memory, compared = memory_section(out, device, model)
    sections = [[f"# GPU check ({device})"], steps_section(out), kernels_section(out), host_section(out),
                sync_section(out), memory]
    return "\n\n".join("\n".join(s) for s in sections) + "\n", compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="llama-134m")
    args = parser.parse_args()
    text, compared = build_summary(args.out, args.device, args.model)
    (args.out / "summary.md").write_text(text)
    print(text)
    if not compared:
        sys.exit("no memory configuration could be compared with sdp plan")


if __name__ == "__main__":
    main()
