"""User-input errors raised by kernels. Every message names the offending tensor, segment and value.

All of them subclass `ValueError`, so callers that only care about "bad input" can catch that.
"""

from __future__ import annotations


class KernelInputError(ValueError):
    """Tensors, buffers or arguments passed to `pack`/`unpack`/`overlap_average` are unusable
    (wrong dtype, device, shape, strides, mode, buffer too small, buffer aliasing a tensor)."""


class LayoutError(KernelInputError):
    """A bucket layout is inconsistent: bad segment kind, index out of range, duplicate index,
    coverage < 1, or two segments that write the same elements of one tensor."""


class KernelLimitError(KernelInputError):
    """A value exceeds a limit of the Triton launch (e.g. more tiles than the grid allows)."""


class BackendUnavailableError(KernelInputError):
    """The requested backend cannot run these tensors (e.g. Triton on CPU without TRITON_INTERPRET=1)."""
