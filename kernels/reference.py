"""Pure-PyTorch reference of pack / unpack / overlap_average / squared_norm: the semantics the Triton kernels match.

Same signatures as `kernels.triton_ops`. Arithmetic is fixed so that both backends round alike:
a scaled or accumulated value is computed in float32 (``x.float() * scale_j``, ``dst.float() + x``)
and rounded once to the destination dtype; an unscaled copy is a plain dtype cast. The reference
runs on any device, one segment at a time (several kernel launches per segment); it is the
fallback on CPU and the baseline the fused kernels are measured against, not a fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.checks import average_scales, check_no_aliasing, check_partials, check_tensors, check_unpack, prepare_pack_out
from kernels.layout import BucketLayout, Segment


def _held_view(t: torch.Tensor, seg: Segment) -> torch.Tensor:
    # (outer, extent, inner) view of t; the segment is [:, index, :] of it.
    return t.view(seg.outer, seg.extent, seg.inner)


def pack(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    out: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the held slices of `tensors` into ``out[:layout.total_numel]``, times ``scale[j]``; zero its gaps.

    See `kernels.pack` for the parameters.
    """
    out = prepare_pack_out(out, tensors, layout, scale, out_dtype, partials)
    if partials is not None:
        _fill_partials(partials, tensors, layout)
    for start, length in layout.gaps:
        out.narrow(0, start, length).zero_()
    for j, seg in enumerate(layout.segments):
        if seg.numel == 0:
            continue
        src = tensors[seg.tensor_index]
        dst = out.narrow(0, seg.offset, seg.numel)
        if src.dtype == out.dtype and (scale is None or out.dtype == torch.float32):
            # Same dtype: write straight into the buffer, no temporary. In float32 the in-place
            # product is the same float32 operation as the general path below.
            if seg.kind == "whole":
                dst.copy_(src.reshape(-1))
            else:
                dst3 = dst.view(seg.outer, len(seg.index), seg.inner)
                torch.index_select(_held_view(src, seg), 1, layout.index_tensors[j], out=dst3)
            if scale is not None:
                dst.mul_(scale[j])
            continue
        if seg.kind == "whole":
            held = src.reshape(-1)
        else:
            held = _held_view(src, seg).index_select(1, layout.index_tensors[j]).reshape(-1)  # (numel,)
        dst.copy_(held if scale is None else held.float() * scale[j])
    return out


def unpack(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    *,
    mode: str = "copy",
    scale: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> None:
    """Scatter ``buffer[:layout.total_numel]`` (times ``scale[j]``) back into the held slices of `tensors`.

    See `kernels.unpack` for the parameters.
    """
    check_unpack(buffer, tensors, layout, mode, scale, partials)
    _unpack(buffer, tensors, layout, mode, scale)
    if partials is not None:
        _fill_partials(partials, tensors, layout)


def _unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], layout: BucketLayout, mode: str,
            scale: torch.Tensor | None) -> None:
    for j, seg in enumerate(layout.segments):
        if seg.numel == 0:
            continue
        dst = tensors[seg.tensor_index]
        values = buffer.narrow(0, seg.offset, seg.numel)
        if scale is not None:
            values = values.float() * scale[j]
        if seg.kind == "whole":
            flat = dst.view(-1)
            flat.copy_(flat.float() + values.float() if mode == "accumulate" else values)
            continue
        index = layout.index_tensors[j]
        view = _held_view(dst, seg)  # (outer, extent, inner)
        values = values.view(seg.outer, len(seg.index), seg.inner)
        if mode == "accumulate":
            values = view.index_select(1, index).float() + values.float()
        view.index_copy_(1, index, values.to(dst.dtype))


def squared_norm(tensors: Sequence[torch.Tensor], layout: BucketLayout, *, partials: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 sum of squares of every held slice of `tensors`. See `kernels.squared_norm`."""
    check_tensors(tensors, layout)
    check_partials(partials, layout)
    if partials is None:
        return _squared_norm(tensors, layout)
    check_no_aliasing(partials, tensors, "partials")
    _fill_partials(partials, tensors, layout)
    return partials


def _fill_partials(partials: torch.Tensor, tensors: Sequence[torch.Tensor], layout: BucketLayout) -> None:
    # The whole sum in the first entry: only the sum of `partials` is specified, not its split.
    partials.zero_()
    if layout.num_norm_partials:
        partials[0] = _squared_norm(tensors, layout)


def _squared_norm(tensors: Sequence[torch.Tensor], layout: BucketLayout) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=layout.device)
    for j, seg in enumerate(layout.segments):
        if seg.numel and seg.in_norm:
            src = tensors[seg.tensor_index]
            held = src if seg.kind == "whole" else _held_view(src, seg).index_select(1, layout.index_tensors[j])
            total += held.float().pow(2).sum()
    return total


def overlap_average(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    all_reduce_fn: Callable[[torch.Tensor], object],
    *,
    buffer: torch.Tensor | None = None,
    buffer_dtype: torch.dtype | None = None,
    divide: str = "before",
) -> torch.Tensor:
    """Pack, sum over holders with `all_reduce_fn`, unpack: each held slice becomes its holders' average.

    See `kernels.overlap_average` for the parameters.
    """
    pack_scale, unpack_scale = average_scales(layout, divide)
    buffer = pack(tensors, layout, buffer, scale=pack_scale, out_dtype=buffer_dtype)
    all_reduce_fn(buffer.narrow(0, 0, layout.total_numel))
    unpack(buffer, tensors, layout, mode="copy", scale=unpack_scale)
    return buffer
