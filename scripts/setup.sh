#!/usr/bin/env bash
# Sets up .venv with the project and its development tools.
#
# - The venv sees the system's site-packages, so a torch that is already installed (a CUDA
#   build, say) is kept, not replaced.
# - Without torch and without an NVIDIA GPU, it installs the CPU build torch==2.13.0 first;
#   the project's own range (torch>=2.13) is then already satisfied and pulls nothing more.
# - It installs the eval extra (lm-eval) beside dev, so that the suite tests `sdp eval`.
# - It byte-compiles the project's sources (an editable install does not): with
#   PYTHONDONTWRITEBYTECODE set, every process would otherwise compile them again, and the test
#   suite starts hundreds (each rank of each launch).
# Idempotent: a second run only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${SDP_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv --system-site-packages .venv
fi
pip=(.venv/bin/python -m pip install --quiet)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${pip[@]}" "torch>=2.13"
    else
        "${pip[@]}" "torch==2.13.0"
    fi
fi
"${pip[@]}" -e ".[dev,eval]"
.venv/bin/python -m compileall -q masklab theory kernels sdp_train tests examples benchmarks scripts >/dev/null
