"""Backend choice: the fused Triton kernels where they can run, the PyTorch reference elsewhere.

``backend="auto"`` picks Triton for CUDA tensors when the kernels are compiled, Triton for CPU
tensors when the kernels were built under TRITON_INTERPRET=1 (so CPU-only CI exercises the Triton
code itself), and the reference otherwise (CPU without the interpreter, CUDA tensors with
interpreted kernels, other devices, no triton installed).
``"triton"`` and ``"reference"`` force one, and "triton" fails loudly where it cannot run.
This module imports triton only when Triton is a candidate.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import torch

from kernels import reference
from kernels.errors import BackendUnavailableError, KernelInputError

BACKENDS = ("auto", "triton", "reference")


def _interpret_requested() -> bool:
    """Triton's interpreter knob; read from the environment, as Triton does, while triton is not
    imported yet (importing it costs every CPU process half a second for nothing)."""
    triton = sys.modules.get("triton")
    if triton is None:
        return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes", "y")
    return bool(triton.knobs.runtime.interpret)


def _triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None if they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type not in ("cuda", "cpu"):
        return f"the Triton kernels support cuda and cpu (interpreted) tensors, not {device.type}"
    if device.type == "cpu" and not _interpret_requested():
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    from kernels import triton_ops

    if device.type == "cuda" and triton_ops.INTERPRETED:
        # The interpreter would run every program on the host, copying the tensors back and forth.
        return "kernels.triton_ops was imported under TRITON_INTERPRET=1, so its kernels are interpreted, not compiled for the GPU"
    if device.type == "cpu" and not triton_ops.INTERPRETED:
        return "kernels.triton_ops was imported before TRITON_INTERPRET=1 was set, so its kernels are compiled for the GPU"
    return None


def block_size_for(device: torch.device) -> int:
    """The tile (elements per Triton program) for layouts whose kernels run on `device`.

    `kernels.layout.DEFAULT_BLOCK_SIZE`, what a GPU runs, except where Triton's interpreter runs CPU
    tensors: there every program is Python over numpy, tens of milliseconds whatever its size, so
    the largest tile (`kernels.layout.MAX_BLOCK_SIZE`) runs the same kernel code in 16 times fewer
    programs. The tests pin other tiles where the tile is what they test (tests/kernels).

    >>> block_size_for(torch.device("meta"))
    1024
    """
    from kernels.layout import DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE

    if device.type == "cpu" and _triton_unavailable_reason(device) is None:
        return MAX_BLOCK_SIZE
    return DEFAULT_BLOCK_SIZE


def select_backend(backend: str, device: torch.device) -> ModuleType:
    """The module (`kernels.reference` or `kernels.triton_ops`) that runs `backend` on `device`.

    Both modules expose `pack`, `unpack`, `overlap_average` and `squared_norm` with identical signatures.
    """
    if backend not in BACKENDS:
        raise KernelInputError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "reference":
        return reference
    reason = _triton_unavailable_reason(device)
    if reason is None:
        from kernels import triton_ops

        return triton_ops
    if backend == "triton":
        raise BackendUnavailableError(f"backend='triton' cannot run tensors on {device}: {reason}")
    return reference
