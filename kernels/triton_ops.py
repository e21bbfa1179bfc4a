"""Fused Triton kernels for pack / unpack / overlap_average / squared_norm: one launch per bucket and operation.

Each program reads one descriptor row of the layout's work list (`kernels.worklist`: its fields
are independent loads, then one load of the tensor's address) and moves one 2-D tile with no
division: a contiguous run (128-bit accesses when aligned), a gather whose int32 column offsets
it loads once and reuses for every row, or (pack only) a run of zeros over the padding between
segments. Tensors are reached through a device table of their data_ptr()s (int64 addresses cast
with ``.to(tl.pointer_type(dtype))``), which works on the GPU and under TRITON_INTERPRET=1
alike. Tile starts are int64, so buffers and tensors past 2**31 elements address correctly;
in-tile offsets are int32 (the host keeps them below 2**31). Every output element has exactly one
writer (the layout rejects overlapping segments), so accumulate mode needs no atomics.

Compiled launches fix FP fusion off (``enable_fp_fusion=False``): a scaled accumulate is a float32
multiply then add, rounded as in `kernels.reference`, whatever Triton's default. Aligned runs
take the vector branch only when every tensor and the buffer are 16-byte aligned (checked on the
host once per address set, see `_launch_plan`; otherwise every run takes the scalar branch).

Whether the kernels run interpreted is fixed when this module is imported (Triton reads
TRITON_INTERPRET when `@triton.jit` decorates), see `INTERPRETED`. Not handled here: input checks
(`kernels.checks`) and backend choice (`kernels.dispatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.checks import average_scales, check_no_aliasing, check_partials, check_tensors, check_unpack, prepare_pack_out
from kernels.layout import BucketLayout
from kernels.worklist import DESC_WIDTH, KIND_GATHER, KIND_RUN_ALIGNED, KIND_ZERO

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
ELEMENTS_PER_THREAD = 8  # num_warps follows the block size: 8 elements (two or one 128-bit accesses) a thread
MAX_WARPS = 32  # 1024 threads, the CUDA limit per program
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_DESC: tl.constexpr = tl.constexpr(DESC_WIDTH)
_RUN_ALIGNED: tl.constexpr = tl.constexpr(KIND_RUN_ALIGNED)
_GATHER: tl.constexpr = tl.constexpr(KIND_GATHER)
_ZERO: tl.constexpr = tl.constexpr(KIND_ZERO)
_ALIGN: tl.constexpr = tl.constexpr(8)  # kernels.worklist.ALIGN_ELEMENTS
# What a tile does (`_direction`): move tensor -> buffer or back, read only, or move and also sum the squares.
OP_PACK, OP_UNPACK, OP_NORM, OP_PACK_NORM, OP_UNPACK_NORM = 0, 1, 2, 3, 4
_PACK: tl.constexpr = tl.constexpr(OP_PACK)
_UNPACK: tl.constexpr = tl.constexpr(OP_UNPACK)
_NORM: tl.constexpr = tl.constexpr(OP_NORM)
_PACK_NORM: tl.constexpr = tl.constexpr(OP_PACK_NORM)
_UNPACK_NORM: tl.constexpr = tl.constexpr(OP_UNPACK_NORM)


def num_warps_for(block_size: int) -> int:
    """Warps per program for a tile of `block_size` elements: ELEMENTS_PER_THREAD each, 1 to MAX_WARPS."""
    return max(1, min(MAX_WARPS, block_size // (32 * ELEMENTS_PER_THREAD)))


@triton.jit
def tile_descriptor(descriptors, tile):
    """The tile's descriptor row, unpacked (see kernels.worklist.DESC_*)."""
    row = descriptors + tile.to(tl.int64) * _DESC
    tensor_start = tl.load(row + 0)
    buffer_start = tl.load(row + 1)
    strides = tl.load(row + 2)
    shape = tl.load(row + 3)
    ids = tl.load(row + 4)
    kind = tl.load(row + 5).to(tl.int32)
    col_start = tl.load(row + 6)
    return (tensor_start, buffer_start, strides.to(tl.int32), (strides >> 32).to(tl.int32), shape.to(tl.int32),
            (shape >> 32).to(tl.int32), ids.to(tl.int32), (ids >> 32).to(tl.int32), kind, col_start)


@triton.jit
def _cast(x, DTYPE: tl.constexpr, HW_BF16: tl.constexpr):
    """x cast to DTYPE, rounding to nearest even like torch.

    Compiled, float32 -> bfloat16 is the hardware conversion. The interpreter truncates it, so
    there the cast is done on the bits (NaN becomes 0x7FC0 as in torch).
    """
    if x.dtype == DTYPE:
        return x
    if DTYPE == tl.bfloat16 and not HW_BF16:
        x = x.to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _move(src, dst, mask, factor, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr,
          NORM: tl.constexpr, NORM_OF_SRC: tl.constexpr):
    """dst = cast(src * factor), or cast(dst + src * factor); float32 arithmetic when scaled or accumulated.

    Returns the float32 sum of squares of what was loaded from src (NORM_OF_SRC) or stored to dst
    when NORM, else 0: the same values and the same reduction as `_direction`'s OP_NORM.
    """
    loaded = tl.load(src, mask=mask)
    x = loaded
    if HAS_SCALE:
        x = x.to(tl.float32) * factor
    if ACCUMULATE:
        x = tl.load(dst, mask=mask).to(tl.float32) + x.to(tl.float32)
    stored = _cast(x, dst.dtype.element_ty, HW_BF16)
    tl.store(dst, stored, mask=mask)
    total = tl.zeros((), tl.float32)
    if NORM:
        if NORM_OF_SRC:
            v = tl.where(mask, loaded.to(tl.float32), 0.0)
        else:
            v = tl.where(mask, stored.to(tl.float32), 0.0)
        total = tl.sum(v * v)
    return total


@triton.jit
def _direction(t, b, mask, factor, OP: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr):
    """OP_PACK (tensor -> buffer), OP_UNPACK, OP_NORM (no move), OP_PACK_NORM, OP_UNPACK_NORM.

    Returns the tile's float32 sum of squares of the tensor side (as read by a pack, as written by
    an unpack) for the three OPs with a norm, else 0.
    """
    total = tl.zeros((), tl.float32)
    if OP == _PACK:
        total = _move(t, b, mask, factor, HAS_SCALE, False, HW_BF16, False, True)
    elif OP == _PACK_NORM:
        total = _move(t, b, mask, factor, HAS_SCALE, False, HW_BF16, True, True)
    elif OP == _UNPACK:
        total = _move(b, t, mask, factor, HAS_SCALE, ACCUMULATE, HW_BF16, False, False)
    elif OP == _UNPACK_NORM:
        total = _move(b, t, mask, factor, HAS_SCALE, ACCUMULATE, HW_BF16, True, False)
    else:
        x = tl.load(t, mask=mask, other=0.0).to(tl.float32)
        total = tl.sum(x * x)
    return total


@triton.jit
def _gather_tile(tensor, buffer, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, col_start, factor,
                 OP: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr,
                 BLOCK: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, BLOCK // COLS)[:, None]
    k = tl.arange(0, COLS)
    cols = tl.load(columns + col_start + k, mask=k < ncols, other=0)  # (COLS,) once per tile, reused by every row
    t = tensor + tensor_start + (r * t_stride + cols[None, :])
    b = buffer + buffer_start + (r * b_stride + k[None, :])
    return _direction(t, b, (r < nrows) & (k[None, :] < ncols), factor, OP, HAS_SCALE, ACCUMULATE, HW_BF16)


@triton.jit
def _run_tile(tensor, buffer, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, factor,
              OP: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr,
              BLOCK: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, BLOCK // COLS)[:, None]
    k = tl.arange(0, COLS)[None, :]
    t = tensor + tensor_start + (r * t_stride + k)
    b = buffer + buffer_start + (r * b_stride + k)
    return _direction(t, b, (r < nrows) & (k < ncols), factor, OP, HAS_SCALE, ACCUMULATE, HW_BF16)


@triton.jit
def _aligned_run_tile(tensor, buffer, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, factor,
                      OP: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr,
                      BLOCK: tl.constexpr, COLS: tl.constexpr):
    # Starts, strides and width are multiples of 8 elements (kernels.worklist), the pointers
    # 16-byte aligned (checked on the host): the hints let Triton emit 128-bit accesses. They sit
    # on values computed here (a hint on a function argument is dropped when Triton inlines).
    r = tl.arange(0, BLOCK // COLS)[:, None]
    k = tl.arange(0, COLS)[None, :]
    t = tl.multiple_of(tensor + tensor_start, 16)
    b = tl.multiple_of(buffer + buffer_start, 16)
    t_off = tl.max_contiguous(tl.multiple_of(r * t_stride + k, [1, _ALIGN]), [1, COLS])
    b_off = tl.max_contiguous(tl.multiple_of(r * b_stride + k, [1, _ALIGN]), [1, COLS])
    mask = tl.max_constancy((r < nrows) & (k < ncols), [1, _ALIGN])
    return _direction(t + t_off, b + b_off, mask, factor, OP, HAS_SCALE, ACCUMULATE, HW_BF16)


@triton.jit
def _tile(tensor, buffer, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, kind, col_start, factor,
          OP: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, HW_BF16: tl.constexpr,
          BLOCK: tl.constexpr, RUN_COLS: tl.constexpr, GATHER_COLS: tl.constexpr, ALIGNED: tl.constexpr):
    """Move one data tile between `tensor` (typed pointer) and `buffer` as OP says (see `_direction`)."""
    if kind == _GATHER:
        total = _gather_tile(tensor, buffer, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, col_start, factor,
                     OP, HAS_SCALE, ACCUMULATE, HW_BF16, BLOCK, GATHER_COLS)
    elif ALIGNED and kind == _RUN_ALIGNED:
        total = _aligned_run_tile(tensor, buffer, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, factor,
                          OP, HAS_SCALE, ACCUMULATE, HW_BF16, BLOCK, RUN_COLS)
    else:
        total = _run_tile(tensor, buffer, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, factor,
                  OP, HAS_SCALE, ACCUMULATE, HW_BF16, BLOCK, RUN_COLS)
    return total


@triton.jit
def _tensor_pointer(pointers, tensor_index, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    address = tl.load(pointers + tensor_index)
    if ALIGNED:
        address = tl.multiple_of(address, 16)
    return address.to(tl.pointer_type(DTYPE))


@triton.jit
def _counted(total, norm_flags, segment):
    """The tile's sum of squares where its segment counts in the norm (`SegmentSpec.in_norm`), else 0."""
    return tl.where(tl.load(norm_flags + segment) != 0, total, 0.0)


@triton.jit
def _pack_kernel(
    pointers, descriptors, columns, scale, norm_flags, out, partials,
    SRC_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, OP: tl.constexpr, HW_BF16: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr, RUN_COLS: tl.constexpr, GATHER_COLS: tl.constexpr,
):
    """OP is OP_PACK, or OP_PACK_NORM: each data tile also stores its sum of squares in partials[tile]
    (0 for a segment whose norm_flags entry is 0)."""
    tile = tl.program_id(0)
    (tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, tensor_index, segment, kind,
     col_start) = tile_descriptor(descriptors, tile)
    if kind == _ZERO:
        k = tl.arange(0, BLOCK)
        tl.store(out + buffer_start + k, tl.zeros((BLOCK,), out.dtype.element_ty), mask=k < ncols)
    else:
        tensor = _tensor_pointer(pointers, tensor_index, SRC_DTYPE, ALIGNED)
        factor = 1.0
        if HAS_SCALE:
            factor = tl.load(scale + segment)
        total = _tile(tensor, out, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, kind, col_start,
                      factor, OP, HAS_SCALE, False, HW_BF16, BLOCK, RUN_COLS, GATHER_COLS, ALIGNED)
        if OP == _PACK_NORM:
            tl.store(partials + tile, _counted(total, norm_flags, segment))


@triton.jit
def _unpack_kernel(
    pointers, descriptors, columns, scale, norm_flags, buffer, partials,
    DST_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, OP: tl.constexpr, HW_BF16: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr, RUN_COLS: tl.constexpr, GATHER_COLS: tl.constexpr,
):
    """OP is OP_UNPACK, or OP_UNPACK_NORM: each tile also stores the sum of squares it wrote in partials[tile]."""
    tile = tl.program_id(0)
    (tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, tensor_index, segment, kind,
     col_start) = tile_descriptor(descriptors, tile)
    tensor = _tensor_pointer(pointers, tensor_index, DST_DTYPE, ALIGNED)
    factor = 1.0
    if HAS_SCALE:
        factor = tl.load(scale + segment)
    total = _tile(tensor, buffer, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, kind, col_start,
                  factor, OP, HAS_SCALE, ACCUMULATE, HW_BF16, BLOCK, RUN_COLS, GATHER_COLS, ALIGNED)
    if OP == _UNPACK_NORM:
        tl.store(partials + tile, _counted(total, norm_flags, segment))


@triton.jit
def _squared_norm_kernel(
    pointers, descriptors, columns, norm_flags, partials,
    DTYPE: tl.constexpr, HW_BF16: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr, RUN_COLS: tl.constexpr, GATHER_COLS: tl.constexpr,
):
    tile = tl.program_id(0)
    (tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, tensor_index, segment, kind,
     col_start) = tile_descriptor(descriptors, tile)
    tensor = _tensor_pointer(pointers, tensor_index, DTYPE, ALIGNED)
    total = _tile(tensor, tensor, columns, tensor_start, buffer_start, t_stride, b_stride, nrows, ncols, kind, col_start, 1.0,
                  _NORM, False, False, HW_BF16, BLOCK, RUN_COLS, GATHER_COLS, ALIGNED)
    tl.store(partials + tile, _counted(total, norm_flags, segment))  # one partial per tile, summed after: deterministic


def _aligned(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> bool:
    return buffer.data_ptr() % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def kernel_constexprs(tensors: Sequence[torch.Tensor], layout: BucketLayout, buffer: torch.Tensor) -> dict[str, Any]:
    """The compile-time constants a launch passes: hardware bf16, 16-byte alignment of every operand, tile sizes."""
    return dict(HW_BF16=not INTERPRETED, ALIGNED=_aligned(tensors, buffer), BLOCK=layout.block_size,
                RUN_COLS=layout.run_cols, GATHER_COLS=layout.gather_cols)


def _options(layout: BucketLayout) -> dict[str, Any]:
    return dict(num_warps=num_warps_for(layout.block_size), enable_fp_fusion=False)


def _launch_plan(tensors: Sequence[torch.Tensor], layout: BucketLayout, buffer: torch.Tensor, name: str,
                 partials: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """(pointer table, compile-time constants and options) of a launch, after its aliasing check.

    All three follow from the key alone: the operands' addresses, dtypes and the buffer's size (the
    checks that run every launch fix the tensors' shapes and the partials' size). So they are
    cached per layout and key (`BucketLayout.launch_plan`), and a steady-state step, whose
    gradients come back at one of a few addresses, validates none of it again.
    """
    key = (tuple(t.data_ptr() for t in tensors), tensors[0].dtype if tensors else None, buffer.data_ptr(),
           buffer.numel(), buffer.dtype, None if partials is None else partials.data_ptr())

    def build() -> tuple[torch.Tensor, dict[str, Any]]:
        check_no_aliasing(buffer, tensors, name, partials)
        return layout.pointer_table(tensors), {**kernel_constexprs(tensors, layout, buffer), **_options(layout)}

    return layout.launch_plan(key, build)


def pack(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    out: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused gather of every segment of the bucket into ``out``, and the held slices' squared norm
    into `partials` if given; one launch. See `kernels.pack`."""
    out = prepare_pack_out(out, tensors, layout, scale, out_dtype, partials, aliasing=False)
    pointers, constants = _launch_plan(tensors, layout, out, "out", partials)
    if layout.num_tiles:
        _pack_kernel[(layout.num_tiles,)](
            pointers, layout.descriptors, layout.column_offsets,
            layout.inverse_coverage if scale is None else scale, layout.norm_flags, out, partials,
            SRC_DTYPE=_TL_DTYPES[tensors[0].dtype], HAS_SCALE=scale is not None,
            OP=OP_PACK if partials is None else OP_PACK_NORM, **constants,
        )
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
    """Fused scatter of ``buffer`` into every segment of the bucket, and the squared norm of what it
    wrote into `partials` if given; one launch. See `kernels.unpack`."""
    check_unpack(buffer, tensors, layout, mode, scale, partials, aliasing=False)
    pointers, constants = _launch_plan(tensors, layout, buffer, "buffer", partials)
    if layout.num_data_tiles:
        _unpack_kernel[(layout.num_data_tiles,)](
            pointers, layout.descriptors, layout.column_offsets,
            layout.inverse_coverage if scale is None else scale, layout.norm_flags, buffer, partials,
            DST_DTYPE=_TL_DTYPES[tensors[0].dtype], HAS_SCALE=scale is not None, ACCUMULATE=mode == "accumulate",
            OP=OP_UNPACK if partials is None else OP_UNPACK_NORM, **constants,
        )


def squared_norm(tensors: Sequence[torch.Tensor], layout: BucketLayout, *, partials: torch.Tensor | None = None) -> torch.Tensor:
    """Fused float32 sum of squares of every held slice, without packing; one launch (and, without
    `partials`, one sum). See `kernels.squared_norm`."""
    check_tensors(tensors, layout)
    check_partials(partials, layout)
    out = torch.empty(layout.num_data_tiles, dtype=torch.float32, device=layout.device) if partials is None else partials
    pointers, constants = _launch_plan(tensors, layout, out, "partials")
    if layout.num_data_tiles:
        _squared_norm_kernel[(layout.num_data_tiles,)](
            pointers, layout.descriptors, layout.column_offsets, layout.norm_flags, out,
            DTYPE=_TL_DTYPES[tensors[0].dtype], **constants,
        )
    return out.sum() if partials is None else partials


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
