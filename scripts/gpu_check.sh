#!/usr/bin/env bash
# The project's checks on a real GPU, in one run of under 8 minutes, everything written to $OUT.
#
#   OUT=/path/to/results PYTHONPATH=. scripts/gpu_check.sh [--dry-run] [--modes "ddp bsdp nsdp bbsdp"]
#
# For a GPU machine with torch and triton preinstalled and no internet, run from the checkout
# (nothing is installed). Steps, each with its own time limit; one failing does not stop the
# others, and steps.tsv records every exit status and duration:
#   env          versions, nvidia-smi
#   kernel_tests tests/kernels on the device: the compiled kernels bit-exact against the
#                reference, dispatch, and the sm_90/sm_80 codegen contract
#   bench        benchmarks/bench_kernels.py --quick, eager baselines (bench_kernels.json holds every row)
#   train_MODE   a short `sdp train` of each mode: one process per mode on one device, or one
#                rank per device (torch's elastic launcher, as torchrun) when there are several
#   plan         `sdp plan` for the same model, workers, batch and sequence length
#   memory       memory.md: measured peak per rank of each run against the plan's prediction
#   bench_compiled  the benchmark's torch.compile baselines (bf16 buffers), in the time left
# --dry-run runs every step on the CPU (TRITON_INTERPRET=1, CUDA hidden), small and short: it
# proves the script works without a GPU (tests/kernels/test_gpu_check.py runs it).
# Exit status: 0 if every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
modes="ddp bsdp nsdp bbsdp"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --modes) modes="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
: "${OUT:?gpu_check.sh: set OUT to the directory that receives the results}"
mkdir -p "$OUT"
python=${PYTHON:-python}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=0  # the kernels set it per launch; this silences Triton's warning elsewhere

if [ "$dry_run" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 OMP_NUM_THREADS=1
    device=cpu workers=1 steps=1 batch=2 seq=16
    test_args=(tests/kernels/test_dispatch.py)  # the suite runs the rest of tests/kernels on the CPU
    bench_args=(--device cpu --smoke --no-compile --buffer-dtype float32)
    train_args=(--max-data-bytes 200000 --eval-batches 1)
    train_env=(env TRITON_INTERPRET=0)  # the sync engine on the reference backend: interpreting it is slow
    memory_per_device=8GiB
else
    device=cuda steps=20 batch=8 seq=64
    workers=$("$python" -c "import torch; print(torch.cuda.device_count())")
    test_args=(tests/kernels)
    bench_args=(--device cuda --quick)
    train_args=(--eval-batches 2)
    train_env=()
    memory_per_device=$("$python" -c "import torch; print(torch.cuda.mem_get_info()[1])")
fi
printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"
SECONDS=0
budget=470  # seconds: the whole run stays under 8 minutes
failed=0

step() {  # step NAME LIMIT_SECONDS COMMAND...: output in $OUT/NAME.txt, status in steps.tsv
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/steps.tsv"
    if [ "$rc" != 0 ]; then
        failed=1
        echo "   failed (exit $rc), last lines of $OUT/$name.txt:"
        tail -5 "$OUT/$name.txt" | sed 's/^/   /'
    fi
}

environment() {
    date -u +"%Y-%m-%d %H:%M UTC"
    uname -a
    "$python" -c "import platform, torch, triton; print('python', platform.python_version(), '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| devices', torch.cuda.device_count())"
    if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    git log -1 --format="commit %H %s" 2>/dev/null || true
}

export python
export -f environment
step env 30 bash -c environment
step kernel_tests 160 "$python" -m pytest "${test_args[@]}" -q -p no:cacheprovider \
    --ignore=tests/kernels/test_gpu_check.py --junitxml="$OUT/kernel_tests.xml"
step bench 90 "$python" -u benchmarks/bench_kernels.py "${bench_args[@]}" --no-compile --json "$OUT/bench_kernels.json"
for mode in $modes; do
    step "train_$mode" 40 ${train_env[@]+"${train_env[@]}"} "$python" -m sdp_train.cli train --mode "$mode" --workers "$workers" --steps "$steps" \
        --batch-size "$batch" --seq-len "$seq" --out "$OUT/train/$mode" "${train_args[@]}"
done
step plan 30 "$python" -m sdp_train.cli plan --model llama-debug --workers "$workers" --memory-per-device "$memory_per_device" \
    --batch-size "$batch" --seq-len "$seq" --device "$device" --json
step memory 20 "$python" - "$OUT" "$device" << 'EOF'
"""memory.md: each run's measured peak per rank against `sdp plan`'s prediction for its mode and C."""
import json, sys
from pathlib import Path

out, device = Path(sys.argv[1]), sys.argv[2]
text = (out / "plan.txt").read_text()
plan = json.loads(text[text.index("["):])
lines = [f"# Measured vs predicted peak memory per rank ({device})", "",
         "| mode | C | ranks | measured max MiB | predicted MiB | measured / predicted |", "|---|---|---|---|---|---|"]
missing = []
for summary in sorted(out.glob("train/*/summary.json")):
    s = json.loads(summary.read_text())
    mode, active = s["config"]["mode"], s["config"]["active"] or 1.0
    rows = [r for r in plan if r["mode"] == mode and not r.get("fsdp")] or [r for r in plan if r["mode"] == mode]
    if not rows:
        missing.append(mode)
        continue
    row = min(rows, key=lambda r: abs(r["active"] - (1.0 if mode == "ddp" else active)))
    measured = max(r["total"] for r in s["peak_memory_bytes"])
    predicted = row["total"] - row["communicators"]  # NCCL's memory is outside what the allocator reports
    lines.append(f"| {mode} | {row['active']:g} | {s['world_size']} | {measured / 2**20:.1f} | {predicted / 2**20:.1f} "
                 f"| {measured / predicted:.2f} |")
(out / "memory.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
if missing or len(lines) == 4:
    sys.exit(f"no prediction or no run for: {missing or 'every mode'}")
EOF
# Last, in whatever remains of the 8 minutes: the torch.compile baselines (each bucket compiles anew).
remaining=$(( budget - SECONDS ))
if [ "$dry_run" = 1 ] || [ "$remaining" -lt 30 ]; then
    printf 'bench_compiled\tskipped\t0\n' >> "$OUT/steps.tsv"
else
    step bench_compiled "$remaining" "$python" -u benchmarks/bench_kernels.py "${bench_args[@]}" --buffer-dtype bfloat16 \
        --json "$OUT/bench_kernels_compiled.json"
fi
echo "== done: $OUT/steps.tsv"
cat "$OUT/steps.tsv"
exit "$failed"
