"""The per-layout work list of the fused kernels: every tile's addresses precomputed on the host.

A segment is ``t.view(outer, extent, inner)[:, index, :]`` flattened (see `kernels.layout`). Its
held columns fall into maximal runs of consecutive indices. A run of at least `RUN_MIN_ELEMENTS`
contiguous elements (a whole tensor, consecutive held rows merged, a long run of held columns) is
copied as a *run*: contiguous on both sides, row after row with fixed strides. Short runs are
joined into a *gather*: the tensor-side column offsets (int32, relative to the tile) are stored
once per layout in `WorkList.columns`, a tile loads them once and reuses them for every row it
covers. A *zero* tile clears the padding between segments in the buffer (pack only).

Every tile is one row of `WorkList.descriptors` (columns ``DESC_*``, int64): a 2-D block of at
most ``nrows`` rows by ``ncols`` columns whose element (r, k) is read/written at

    tensor: pointer + tensor_start + r * tensor_stride + (k        for runs | columns[col_start + k] for gathers)
    buffer: buffer  + buffer_start + r * buffer_stride + k

so a program does no division, only int32 multiply-adds inside the tile (the host bounds every
in-tile offset below 2**31) on top of two int64 starts. A run tile whose starts, strides and width
are multiples of `ALIGN_ELEMENTS` is marked aligned: with 16-byte aligned pointers the kernel may
then use 128-bit accesses. Tile widths (`run_cols`, `gather_cols`, powers of two) are chosen per
layout to minimise the number of tiles. Nothing here touches a device or a tensor's data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kernels.errors import KernelLimitError

KIND_RUN_ALIGNED, KIND_RUN, KIND_GATHER, KIND_ZERO = 0, 1, 2, 3
# Columns of WorkList.descriptors; pairs of non-negative int32 values share one int64 column.
DESC_TENSOR_START, DESC_BUFFER_START = 0, 1
DESC_STRIDES = 2  # tensor_stride | buffer_stride << 32
DESC_SHAPE = 3  # nrows | ncols << 32
DESC_IDS = 4  # tensor_index | segment << 32
DESC_KIND = 5
DESC_COL_START = 6
DESC_WIDTH = 7
ALIGN_ELEMENTS = 8  # 16 bytes of a 2-byte dtype, 32 of a 4-byte one
RUN_MIN_ELEMENTS = 64
MIN_TILE_COLS = 16
INT32_MAX = 2**31 - 1
MAX_GRID_TILES = 2**31 - 1  # CUDA limit on grid dimension x


@dataclass(frozen=True)
class _Piece:
    """`rows` rows of one segment; row a starts at tensor_start + a*tensor_stride (buffer alike).

    ``columns`` is None for a run of `length` contiguous elements per row, else the tensor-side
    offsets of a gather (relative to the row start), stored contiguously in the buffer.
    """

    tensor: int
    segment: int
    rows: int
    tensor_start: int
    buffer_start: int
    tensor_stride: int
    buffer_stride: int
    length: int
    columns: np.ndarray | None = None


@dataclass(frozen=True)
class WorkList:
    descriptors: np.ndarray  # (n_tiles, DESC_WIDTH) int64; zero tiles last
    columns: np.ndarray  # (n,) int32 gather column offsets
    run_cols: int
    gather_cols: int
    num_data_tiles: int  # tiles before the zero tiles: all unpack needs

    @property
    def num_tiles(self) -> int:
        return len(self.descriptors)


def aligned_offset(offset: int) -> int:
    """The first multiple of `ALIGN_ELEMENTS` at or after `offset` (16-byte aligned buffer offsets)."""
    return -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def _pieces(seg, j: int) -> list[_Piece]:
    """Runs and gathers of segment `j` (a `kernels.layout.Segment`)."""
    if seg.numel == 0:
        return []
    index = np.asarray(seg.index, dtype=np.int64)
    inner, held = seg.inner, len(seg.index)
    row_t, row_b = seg.extent * inner, held * inner
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    bounds = list(zip([0, *breaks.tolist()], [*breaks.tolist(), held]))
    pieces, short = [], []

    def piece(first, length, columns=None):
        return _Piece(seg.tensor_index, j, seg.outer, 0 if columns is not None else int(index[first]) * inner,
                      seg.offset + first * inner, row_t, row_b, length, columns)

    def flush():
        if short:
            first, last = short[0][0], short[-1][1]
            columns = (index[first:last, None] * inner + np.arange(inner)).ravel()
            pieces.append(piece(first, len(columns), columns))
            short.clear()

    for first, last in bounds:
        length = (last - first) * inner
        if length >= RUN_MIN_ELEMENTS or len(bounds) == 1:
            flush()
            pieces.append(piece(first, length))
        else:
            short.append((first, last))
    flush()
    merged = []
    for p in pieces:  # full rows on both sides: one run over all rows
        if p.columns is None and p.rows > 1 and p.length == p.tensor_stride == p.buffer_stride:
            p = _Piece(p.tensor, p.segment, 1, p.tensor_start, p.buffer_start, 0, 0, p.rows * p.length)
        merged.append(p)
    return merged


def _rows_per_tile(p: _Piece, cap: int, span: int) -> int:
    """Rows of `p` one tile may cover: at most `cap`, and every in-tile offset below 2**31."""
    strides = max(p.tensor_stride, p.buffer_stride)
    if p.rows == 1 or strides == 0:
        return min(cap, p.rows)
    if strides > INT32_MAX - span:
        return 1
    return max(1, min(cap, p.rows, (INT32_MAX - span) // strides + 1))


def _span(p: _Piece, width: int) -> int:
    """Largest in-row offset a tile of `p` reaches (for gathers, over the whole piece)."""
    if p.columns is None:
        return min(width, p.length)
    return max(int(p.columns.max()) - int(p.columns.min()), width)


def _flat_run(p: _Piece, block: int, width: int) -> tuple[bool, int, int, int, int]:
    """A one-row run: (aligned, body, full tiles, rows of the partial tile, width of the last row)."""
    aligned = _aligned(p.tensor_start, p.buffer_start)
    body = p.length - p.length % ALIGN_ELEMENTS if aligned else p.length
    rows, rest = divmod(body % block, width)
    return aligned, body, body // block, rows, rest


def _count(p: _Piece, block: int, width: int) -> int:
    if p.rows == 1 and p.columns is None:
        _, body, full, rows, rest = _flat_run(p, block, width)
        return full + (rows > 0) + (rest > 0) + (body < p.length)
    return -(-p.length // width) * -(-p.rows // _rows_per_tile(p, block // width, _span(p, width)))


def _best_width(pieces: Sequence[_Piece], block: int) -> int:
    """The power-of-two tile width in [MIN_TILE_COLS, block] giving the fewest tiles (widest on ties)."""
    if not pieces:
        return block
    candidates = [2**e for e in range(int(math.log2(min(MIN_TILE_COLS, block))), int(math.log2(block)) + 1)]
    return min(reversed(candidates), key=lambda w: sum(_count(p, block, w) for p in pieces))


def _aligned(*values: int) -> bool:
    return all(v % ALIGN_ELEMENTS == 0 for v in values)


def _tiles(kind, p: _Piece, t_start, b_start, t_stride: int, b_stride: int, nrows, ncols: int, col_start: int = 0) -> np.ndarray:
    """Descriptor rows; `t_start`, `b_start`, `nrows` and `kind` may be arrays (one entry per tile)."""
    t_start, b_start, nrows, kind = (np.atleast_1d(np.asarray(v, dtype=np.int64)) for v in (t_start, b_start, nrows, kind))
    n = max(len(t_start), len(nrows), len(kind))
    multi = nrows > 1  # a one-row tile's strides are unused: stored as 0 (they may exceed int32)
    strides = t_stride | b_stride << 32 if max(t_stride, b_stride) <= INT32_MAX else 0
    out = np.empty((n, DESC_WIDTH), dtype=np.int64)
    out[:, DESC_TENSOR_START], out[:, DESC_BUFFER_START] = t_start, b_start
    out[:, DESC_STRIDES] = np.where(multi, strides, 0)
    out[:, DESC_SHAPE] = nrows | ncols << 32
    out[:, DESC_IDS] = p.tensor | p.segment << 32
    out[:, DESC_KIND], out[:, DESC_COL_START] = kind, col_start
    return out


def _run_tiles(p: _Piece, block: int, width: int) -> list[np.ndarray]:
    tiles, cap = [], block // width
    if p.rows == 1:
        aligned, body, full, rows, rest = _flat_run(p, block, width)
        kind = KIND_RUN_ALIGNED if aligned else KIND_RUN
        if full:
            starts = np.arange(full, dtype=np.int64) * block
            tiles.append(_tiles(kind, p, p.tensor_start + starts, p.buffer_start + starts, width, width, cap, width))
        start = full * block
        if rows:
            tiles.append(_tiles(kind, p, p.tensor_start + start, p.buffer_start + start, width, width, rows, width))
        if rest:
            start += rows * width
            tiles.append(_tiles(kind, p, p.tensor_start + start, p.buffer_start + start, 0, 0, 1, rest))
        if body < p.length:
            tiles.append(_tiles(KIND_RUN, p, p.tensor_start + body, p.buffer_start + body, 0, 0, 1, p.length - body))
        return tiles
    rpt = _rows_per_tile(p, cap, _span(p, width))
    a0 = np.arange(0, p.rows, rpt, dtype=np.int64)
    nrows = np.minimum(rpt, p.rows - a0)
    for c0 in range(0, p.length, width):
        ncols = min(width, p.length - c0)
        t_start, b_start = p.tensor_start + a0 * p.tensor_stride + c0, p.buffer_start + a0 * p.buffer_stride + c0
        aligned = (t_start % ALIGN_ELEMENTS == 0) & (b_start % ALIGN_ELEMENTS == 0) & _aligned(ncols)
        aligned &= (nrows == 1) | _aligned(p.tensor_stride, p.buffer_stride)
        kind = np.where(aligned, KIND_RUN_ALIGNED, KIND_RUN)
        tiles.append(_tiles(kind, p, t_start, b_start, p.tensor_stride, p.buffer_stride, nrows, ncols))
    return tiles


def _gather_tiles(p: _Piece, block: int, width: int, columns: list[np.ndarray], col_start: int) -> tuple[list[np.ndarray], int]:
    span = _span(p, width)
    if span > INT32_MAX:
        raise KernelLimitError(f"segment {p.segment}: its gathered columns span {span} elements, above the int32 limit {INT32_MAX}")
    rpt = _rows_per_tile(p, block // width, span)
    a0 = np.arange(0, p.rows, rpt, dtype=np.int64)
    nrows = np.minimum(rpt, p.rows - a0)
    tiles = []
    for c0 in range(0, p.length, width):
        chunk = p.columns[c0 : c0 + width]
        low = int(chunk.min())
        columns.append((chunk - low).astype(np.int32))
        t_start, b_start = p.tensor_start + a0 * p.tensor_stride + low, p.buffer_start + a0 * p.buffer_stride + c0
        tiles.append(_tiles(KIND_GATHER, p, t_start, b_start, p.tensor_stride, p.buffer_stride, nrows, len(chunk), col_start))
        col_start += len(chunk)
    return tiles, col_start


def build_work_list(segments: Sequence, gaps: Sequence[tuple[int, int]], block: int) -> WorkList:
    """The tiles of a layout's `segments` and of the buffer `gaps` ((start, length) padding) to clear."""
    pieces = [p for j, seg in enumerate(segments) for p in _pieces(seg, j)]
    runs = [p for p in pieces if p.columns is None]
    gathers = [p for p in pieces if p.columns is not None]
    run_cols, gather_cols = _best_width(runs, block), _best_width(gathers, block)
    n_tiles = sum(_count(p, block, run_cols) for p in runs) + sum(_count(p, block, gather_cols) for p in gathers) + len(gaps)
    if n_tiles > MAX_GRID_TILES:
        raise KernelLimitError(
            f"bucket needs {n_tiles} tiles of block_size={block}, above the grid limit {MAX_GRID_TILES}; "
            "raise block_size or split the bucket"
        )
    tiles, columns, col_start = [np.zeros((0, DESC_WIDTH), dtype=np.int64)], [], 0
    for p in runs:
        tiles += _run_tiles(p, block, run_cols)
    for p in gathers:
        more, col_start = _gather_tiles(p, block, gather_cols, columns, col_start)
        tiles += more
    num_data_tiles = sum(len(t) for t in tiles)
    zero = _Piece(0, 0, 1, 0, 0, 0, 0, 0)
    tiles += [_tiles(KIND_ZERO, zero, 0, start, 0, 0, 1, length) for start, length in gaps]
    descriptors = np.concatenate(tiles)
    flat_columns = np.concatenate(columns) if columns else np.zeros(0, dtype=np.int32)
    return WorkList(descriptors, flat_columns, run_cols, gather_cols, num_data_tiles)
