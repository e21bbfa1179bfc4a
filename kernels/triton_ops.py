"""Fused Triton kernels for pack / unpack / overlap_average: one launch per bucket and direction.

Work-list design: `BucketLayout` precomputes one tile (`block_size` elements of one segment) per
Triton program, so the 1-D grid covers every segment of the bucket in a single launch, whatever the
mix of whole tensors and row/column index sets. Tensors are reached through a device table of
their data_ptr()s (int64 addresses cast with ``.to(tl.pointer_type(dtype))``), which works on the
GPU and under TRITON_INTERPRET=1 alike. All offset arithmetic is int64, so buffers and tensors
past 2**31 elements address correctly. Every output element is written by exactly one program
(the layout rejects overlapping segments), so accumulate mode needs no atomics — which also keeps
it inside the interpreter's limits (no bf16 atomics, programs run one after another).

Whether the kernels run interpreted is fixed when this module is imported (Triton reads
TRITON_INTERPRET when `@triton.jit` decorates), see `INTERPRETED`. Not handled here: input checks
(`kernels.checks`) and backend choice (`kernels.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from kernels.checks import average_scales, check_unpack, prepare_pack_out
from kernels.layout import BucketLayout

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
NUM_WARPS = 4
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _segment_offsets(segment_table, index_values, tile_segment, tile_start, tile, BLOCK: tl.constexpr):
    """For program `tile`: (tensor index, element offsets into the tensor, into the buffer, in-range mask).

    All returned offsets are int64; segment element e maps to tensor element
    ``(a * extent + index[j]) * inner + c`` with e = (a * len(index) + j) * inner + c.
    """
    seg = tl.load(tile_segment + tile).to(tl.int64)
    row = segment_table + seg * 8  # columns: see kernels.layout.TABLE_*
    tensor_index = tl.load(row + 0)
    offset = tl.load(row + 1)
    numel = tl.load(row + 2)
    index_start = tl.load(row + 3)
    index_len = tl.load(row + 4)
    extent = tl.load(row + 5)
    inner = tl.load(row + 6)
    is_whole = tl.load(row + 7)
    e = tl.load(tile_start + tile) + tl.arange(0, BLOCK).to(tl.int64)  # (BLOCK,) int64
    in_range = e < numel
    if is_whole != 0:
        src = e
    else:
        held_per_outer = index_len * inner
        a = e // held_per_outer
        rest = e - a * held_per_outer
        j = rest // inner
        c = rest - j * inner
        picked = tl.load(index_values + index_start + j, mask=in_range, other=0)
        src = (a * extent + picked) * inner + c
    return seg, tensor_index, src, offset + e, in_range


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """x cast to DTYPE, rounding to nearest even like torch.

    The interpreter truncates float32 -> bfloat16, so that cast is done here on the bits (the same
    integer ops on GPU and interpreter, hence the same result); NaN becomes 0x7FC0 as in torch.
    """
    if x.dtype == DTYPE:
        return x
    if DTYPE == tl.bfloat16:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _pack_kernel(
    pointer_table, segment_table, index_values, tile_segment, tile_start, scale, out,
    SRC_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    seg, tensor_index, src, dst, in_range = _segment_offsets(
        segment_table, index_values, tile_segment, tile_start, tile, BLOCK
    )
    base = tl.load(pointer_table + tensor_index).to(tl.pointer_type(SRC_DTYPE))
    x = tl.load(base + src, mask=in_range)
    if HAS_SCALE:
        x = x.to(tl.float32) * tl.load(scale + seg)
    tl.store(out + dst, _cast(x, out.dtype.element_ty), mask=in_range)


@triton.jit
def _unpack_kernel(
    pointer_table, segment_table, index_values, tile_segment, tile_start, scale, buffer,
    DST_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    seg, tensor_index, dst, src, in_range = _segment_offsets(
        segment_table, index_values, tile_segment, tile_start, tile, BLOCK
    )
    base = tl.load(pointer_table + tensor_index).to(tl.pointer_type(DST_DTYPE))
    x = tl.load(buffer + src, mask=in_range)
    if HAS_SCALE:
        x = x.to(tl.float32) * tl.load(scale + seg)
    if ACCUMULATE:
        x = tl.load(base + dst, mask=in_range).to(tl.float32) + x.to(tl.float32)
    tl.store(base + dst, _cast(x, DST_DTYPE), mask=in_range)


def pack(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    out: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused gather of every segment of the bucket into ``out``; one launch. See `kernels.pack`."""
    out = prepare_pack_out(out, tensors, layout, scale, out_dtype)
    if layout.num_tiles:
        _pack_kernel[(layout.num_tiles,)](
            layout.pointer_table(tensors), layout.segment_table, layout.index_values,
            layout.tile_segment, layout.tile_start,
            layout.inverse_coverage if scale is None else scale, out,
            SRC_DTYPE=_TL_DTYPES[tensors[0].dtype], HAS_SCALE=scale is not None,
            BLOCK=layout.block_size, num_warps=NUM_WARPS,
        )
    return out


def unpack(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    *,
    mode: str = "copy",
    scale: torch.Tensor | None = None,
) -> None:
    """Fused scatter of ``buffer`` into every segment of the bucket; one launch. See `kernels.unpack`."""
    check_unpack(buffer, tensors, layout, mode, scale)
    if layout.num_tiles:
        _unpack_kernel[(layout.num_tiles,)](
            layout.pointer_table(tensors), layout.segment_table, layout.index_values,
            layout.tile_segment, layout.tile_start,
            layout.inverse_coverage if scale is None else scale, buffer,
            DST_DTYPE=_TL_DTYPES[tensors[0].dtype], HAS_SCALE=scale is not None,
            ACCUMULATE=mode == "accumulate", BLOCK=layout.block_size, num_warps=NUM_WARPS,
        )


def overlap_average(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    all_reduce_fn: Callable[[torch.Tensor], object],
    *,
    buffer: torch.Tensor | None = None,
    buffer_dtype: torch.dtype | None = None,
    divide: str = "before",
) -> torch.Tensor:
    """Fused pack, `all_reduce_fn` on the buffer, fused unpack. See `kernels.overlap_average`."""
    pack_scale, unpack_scale = average_scales(layout, divide)
    buffer = pack(tensors, layout, buffer, scale=pack_scale, out_dtype=buffer_dtype)
    all_reduce_fn(buffer.narrow(0, 0, layout.total_numel))
    unpack(buffer, tensors, layout, mode="copy", scale=unpack_scale)
    return buffer
