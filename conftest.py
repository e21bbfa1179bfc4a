"""Tests run the Triton code itself: interpreted on CPU-only machines, compiled on a GPU.

TRITON_INTERPRET must be set before `kernels.triton_ops` is imported (Triton reads it when
`@triton.jit` decorates), hence in this root conftest, loaded before any test or doctest module imports kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
