"""Input checks shared by every backend, so that reference and Triton reject the same inputs alike.

Each function raises a `KernelInputError` (or subclass) whose message names the tensor, the value
and the expected value. Nothing here moves data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.errors import KernelInputError
from kernels.layout import BucketLayout

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNPACK_MODES = ("copy", "accumulate")
DIVIDE_WHEN = ("before", "after")


def check_tensors(tensors: Sequence[torch.Tensor], layout: BucketLayout) -> torch.dtype:
    """Check the bucket's tensors against `layout`; return their common dtype."""
    if len(tensors) != len(layout.shapes):
        raise KernelInputError(f"got {len(tensors)} tensors, the layout was built for {len(layout.shapes)}")
    dtype = tensors[0].dtype if tensors else torch.float32
    for i, (t, shape) in enumerate(zip(tensors, layout.shapes)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"tensor {i} is a {type(t).__name__}, expected torch.Tensor")
        if t.shape != shape:
            raise KernelInputError(f"tensor {i} has shape {tuple(t.shape)}, the layout expects {tuple(shape)}")
        if t.dtype != dtype:
            raise KernelInputError(f"tensor {i} has dtype {t.dtype}, tensor 0 has {dtype}; a bucket holds one dtype")
        if t.dtype not in SUPPORTED_DTYPES:
            raise KernelInputError(f"tensor {i} has dtype {t.dtype}, supported: {SUPPORTED_DTYPES}")
        if t.device != layout.device:
            raise KernelInputError(f"tensor {i} is on {t.device}, the layout is on {layout.device}")
        if not t.is_contiguous():
            raise KernelInputError(
                f"tensor {i} of shape {tuple(t.shape)} has strides {t.stride()}, not contiguous; "
                "pass t.contiguous() (the kernels address tensors as flat row-major memory)"
            )
    return dtype


def check_buffer(buffer: torch.Tensor, layout: BucketLayout, name: str) -> None:
    """Check a flat buffer: 1-D, contiguous, supported dtype, on the layout's device, large enough."""
    if not isinstance(buffer, torch.Tensor):
        raise KernelInputError(f"{name} is a {type(buffer).__name__}, expected torch.Tensor")
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise KernelInputError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(buffer.shape)} strides {buffer.stride()}")
    if buffer.dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(f"{name} has dtype {buffer.dtype}, supported: {SUPPORTED_DTYPES}")
    if buffer.device != layout.device:
        raise KernelInputError(f"{name} is on {buffer.device}, the layout is on {layout.device}")
    if buffer.numel() < layout.total_numel:
        raise KernelInputError(f"{name} holds {buffer.numel()} elements, the layout needs {layout.total_numel}")


def check_no_aliasing(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], name: str, partials: torch.Tensor | None = None) -> None:
    """Reject a buffer (or `partials`) that shares memory with a tensor, and tensors that share memory with each other.

    The fused kernels read and write in no fixed order, so overlapping memory would give
    order-dependent results.
    """
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"tensor {i}") for i, t in enumerate(tensors) if t.numel()]
    for who, extra in ((name, buffer), ("partials", partials)):
        if extra is not None and extra.numel():
            spans.append((extra.data_ptr(), extra.data_ptr() + extra.numel() * extra.element_size(), who))
    spans.sort()
    for (start_a, end_a, who_a), (start_b, end_b, who_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise KernelInputError(
                f"{who_a} (bytes [{start_a:#x}, {end_a:#x})) and {who_b} (bytes [{start_b:#x}, {end_b:#x})) overlap in memory"
            )


def check_scale(scale: torch.Tensor | None, layout: BucketLayout) -> None:
    """`scale` is None or a (n_segments,) float32 tensor on the layout's device."""
    _check_float32_vector("scale", scale, len(layout.segments), "one factor per segment", layout)


def check_partials(partials: torch.Tensor | None, layout: BucketLayout) -> None:
    """`partials` is None or a 1-D contiguous float32 tensor of ``layout.num_norm_partials`` on the layout's device."""
    _check_float32_vector("partials", partials, layout.num_norm_partials, "layout.num_norm_partials", layout)


def _check_float32_vector(name: str, t: torch.Tensor | None, length: int, meaning: str, layout: BucketLayout) -> None:
    """`t` is None or a contiguous float32 tensor of shape ``(length,)`` on the layout's device."""
    if t is None:
        return
    expected = (length,)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected or t.dtype != torch.float32:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise KernelInputError(f"{name} must be a float32 tensor of shape {expected} ({meaning}), got {got}")
    if t.device != layout.device:
        raise KernelInputError(f"{name} is on {t.device}, the layout is on {layout.device}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous, got strides {t.stride()}")


def prepare_pack_out(
    out: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    scale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    partials: torch.Tensor | None = None,
    *,
    aliasing: bool = True,
) -> torch.Tensor:
    """Run every check of `pack`; return `out`, allocated when None. ``aliasing=False`` leaves
    `check_no_aliasing` to the caller (`kernels.triton_ops` runs it once per address set)."""
    dtype = check_tensors(tensors, layout)
    check_scale(scale, layout)
    check_partials(partials, layout)
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(f"out_dtype={out_dtype} is not supported: {SUPPORTED_DTYPES}")
    if out is None:
        out = torch.empty(layout.total_numel, dtype=out_dtype or dtype, device=layout.device)
        if partials is not None and aliasing:
            check_no_aliasing(out, tensors, "out", partials)
        return out
    check_buffer(out, layout, "out")
    if out_dtype is not None and out.dtype != out_dtype:
        raise KernelInputError(f"out has dtype {out.dtype} but out_dtype={out_dtype}")
    if aliasing:
        check_no_aliasing(out, tensors, "out", partials)
    return out


def check_unpack(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    mode: str,
    scale: torch.Tensor | None,
    partials: torch.Tensor | None = None,
    *,
    aliasing: bool = True,
) -> None:
    """Run every check of `unpack` (``aliasing=False``: all but `check_no_aliasing`)."""
    if mode not in UNPACK_MODES:
        raise KernelInputError(f"mode={mode!r} is not one of {UNPACK_MODES}")
    check_tensors(tensors, layout)
    check_scale(scale, layout)
    check_partials(partials, layout)
    check_buffer(buffer, layout, "buffer")
    if aliasing:
        check_no_aliasing(buffer, tensors, "buffer", partials)


def average_scales(layout: BucketLayout, divide: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pack scale, unpack scale) for `overlap_average`: 1/c_j on the side named by `divide`."""
    if divide not in DIVIDE_WHEN:
        raise KernelInputError(f"divide={divide!r} is not one of {DIVIDE_WHEN}")
    if divide == "before":
        return layout.inverse_coverage, None
    return None, layout.inverse_coverage
