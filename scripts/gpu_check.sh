#!/usr/bin/env bash
# The project's one check on a real GPU: under 7 minutes on one H100/H200 with a cold Triton cache.
#
#   OUT=/path/to/results PYTHONPATH=. scripts/gpu_check.sh [--dry-run] [--configs "ddp bsdp fsdp+ac bsdp+fsdp+ac"]
#
# For a GPU machine with torch and triton preinstalled and no internet, run from the checkout
# (nothing is installed). Every step has its own time limit, and the limits plus each one's kill
# grace add up to at most the 420 s budget (the script refuses to start otherwise), so the run ends
# in time even if every step hits its limit. One failing step does not stop the others; steps.tsv
# records each one's exit status, duration and limit, and summary.md gathers every result:
#   env           versions, nvidia-smi
#   kernel_tests  tests/kernels on the device: the compiled kernels bit-exact against the reference,
#                 the no-sync steady state under torch.cuda.set_sync_debug_mode("error"), dispatch
#   bench         benchmarks/bench_kernels.py --quick: pack/unpack bandwidth against torch copies of the
#                 same bytes and the eager baselines (bench_kernels.json holds every row)
#   step_host     benchmarks/bench_step_host.py on the device: the sync engine's host time per step on
#                 the llama-1b K=8 C=0.5 bucket plan, B-SDP and N-SDP, beside torch DDP's reducer
#   sync_debug    scripts/sync_debug_steps.py: steps 3-5 of `sdp train`'s loop in every mode under
#                 torch.cuda.set_sync_debug_mode("error")
#   memory_CONFIG scripts/memory_ranks.py: per-rank peak memory of each configuration on llama-134m,
#                 2 ranks sharing the GPU over gloo, measured by `sdp train`'s loop
#   plan          `sdp plan` for the same model, ranks, batch and sequence length (plain, and --ac --fsdp)
#   summary       summary.md: the steps, kernel bandwidth, host time, sync check, measured vs predicted memory
# --dry-run runs every step on the CPU (TRITON_INTERPRET=1, CUDA hidden), small and short: it
# proves the script works without a GPU (tests/kernels/test_gpu_check.py runs it). Its steps are
# killed only after 20 x their GPU limit, so a busy CPU cannot fail it; the budget check is the same.
# Exit status: 0 if every step passed, 1 otherwise, 2 for bad arguments or limits over the budget.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
configs="ddp bsdp fsdp+ac bsdp+fsdp+ac"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --configs) configs="$2"; shift ;;
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
# A cold Triton cache, as on a fresh machine: the limits must hold with every kernel compiled anew.
TRITON_CACHE_DIR=$(mktemp -d)
export TRITON_CACHE_DIR
trap 'rm -rf "$TRITON_CACHE_DIR"' EXIT

budget=420  # seconds: 7 minutes, the limits of every step and their kill grace included
grace=5     # seconds between a step's TERM and its KILL
# Limits in seconds, in run order; the memory steps share `memory_limit` each.
declare -A limit=([env]=15 [kernel_tests]=65 [bench]=50 [step_host]=40 [sync_debug]=40 [plan]=25 [summary]=10)
memory_limit=30
read -r -a config_list <<< "$configs"
total=$(( memory_limit * ${#config_list[@]} + (${#config_list[@]} + ${#limit[@]}) * grace ))
for name in "${!limit[@]}"; do total=$(( total + limit[$name] )); done
if [ "$total" -gt "$budget" ]; then
    echo "gpu_check.sh: the step limits and kill grace add up to $total s, over the $budget s budget" >&2
    exit 2
fi

slack=1  # a step is killed after slack x its limit
if [ "$dry_run" = 1 ]; then
    # The limits are the GPU's. On a CPU, and one that other work may share (the test suite runs
    # this beside other tests), they would make the dry run pass or fail by the machine's load:
    # it checks that every step works and that the GPU limits fit the budget, not the CPU's speed.
    slack=20
    export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 OMP_NUM_THREADS=1
    device=cpu
    test_args=(tests/kernels/test_dispatch.py)  # the suite runs the rest of tests/kernels on the CPU
    bench_args=(--device cpu --smoke --no-compile --buffer-dtype float32)
    # the sync engine on the reference backend and the host-path benchmark need compiled (not interpreted) kernels
    host_env=(env TRITON_INTERPRET=0)
    step_host_args=(--device cpu --model llama-debug --workers 2 --steps 2 --shrink 1)
    sync_args=(--device cpu --modes bsdp)
    model=llama-debug batch=2 seq=16 memory_per_device=8GiB
    memory_args=(--device cpu --max-data-bytes 200000 --steps 1)
else
    device=cuda
    test_args=(tests/kernels/test_pack_unpack.py tests/kernels/test_norms.py tests/kernels/test_host_sync.py
               tests/kernels/test_errors.py tests/kernels/test_dispatch.py)
    bench_args=(--device cuda --quick)
    host_env=()
    step_host_args=(--device cuda --steps 20)
    sync_args=(--device cuda)
    model=llama-134m batch=8 seq=256
    memory_per_device=device  # the device's capacity, read inside the plan step (within its limit)
    memory_args=(--device cuda --steps 2)
fi
printf 'step\texit\tseconds\tlimit\tkilled_after\n' > "$OUT/steps.tsv"
failed=0

step() {  # step NAME LIMIT_SECONDS COMMAND...: output in $OUT/NAME.txt, status in steps.tsv
    local name=$1 seconds=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${seconds} s): $*"
    timeout --kill-after="$grace" "$(( seconds * slack ))" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$seconds" "$(( seconds * slack ))" \
        >> "$OUT/steps.tsv"
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

plans() {  # the plain plan (DDP, FSDP, B-SDP, ...) and the one with --ac --fsdp (FSDP+AC, B-SDP+FSDP+AC, ...)
    local capacity=$memory_per_device
    if [ "$capacity" = device ]; then capacity=$("$python" -c "import torch; print(torch.cuda.mem_get_info()[1])") || return; fi
    local common=(--model "$model" --workers 2 --memory-per-device "$capacity" --batch-size "$batch"
                  --seq-len "$seq" --device "$device" --active 0.5 --json)
    "$python" -m sdp_train.cli plan "${common[@]}" > "$OUT/plan.json" &
    "$python" -m sdp_train.cli plan "${common[@]}" --ac --fsdp > "$OUT/plan_ac.json" || return
    wait $!
}

export python OUT model memory_per_device batch seq device
export -f environment plans
step env "${limit[env]}" bash -c environment
step kernel_tests "${limit[kernel_tests]}" "$python" -m pytest "${test_args[@]}" -q -p no:cacheprovider \
    --junitxml="$OUT/kernel_tests.xml"
step bench "${limit[bench]}" "$python" -u benchmarks/bench_kernels.py "${bench_args[@]}" --no-compile --json "$OUT/bench_kernels.json"
step step_host "${limit[step_host]}" ${host_env[@]+"${host_env[@]}"} "$python" -u benchmarks/bench_step_host.py \
    "${step_host_args[@]}" --json "$OUT/step_host.json"
step sync_debug "${limit[sync_debug]}" ${host_env[@]+"${host_env[@]}"} "$python" -u scripts/sync_debug_steps.py "${sync_args[@]}"
for config in "${config_list[@]}"; do
    step "memory_$config" "$memory_limit" ${host_env[@]+"${host_env[@]}"} "$python" -u scripts/memory_ranks.py "$config" \
        --out "$OUT/memory/$config" --model "$model" --workers 2 --batch-size "$batch" --seq-len "$seq" \
        "${memory_args[@]}"
done
step plan "${limit[plan]}" bash -c plans
step summary "${limit[summary]}" "$python" scripts/gpu_check_summary.py "$OUT" --device "$device" --model "$model"
echo "== done: $OUT/summary.md"
cat "$OUT/steps.tsv"
exit "$failed"
