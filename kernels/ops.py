"""Public entry points: `pack`, `unpack`, `overlap_average`, `squared_norm`, each dispatched to a backend.

The sync engine builds one `BucketLayout` per bucket and mask, then calls these every step. With a
preallocated buffer (and preallocated ``partials`` for a norm), that per-step path allocates no
device memory and never waits for the device. This module holds no arithmetic: see
`kernels.reference` for the semantics and `kernels.triton_ops` for the fused kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kernels.dispatch import select_backend
from kernels.layout import BucketLayout


def pack(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    out: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    partials: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gather the held slices of a bucket's tensors into one flat buffer, scaled and cast, in one pass.

    Segment j lands in ``out[seg.offset : seg.offset + seg.numel]`` as
    ``t.view(outer, extent, inner)[:, index, :].flatten()`` (the whole tensor, its held rows, or
    its held columns), multiplied by ``scale[j]`` in float32 and rounded once to ``out.dtype``.

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        The bucket's tensors (e.g. gradients), shapes as in `layout`, one dtype among float32,
        bfloat16, float16, contiguous, on ``layout.device``.
    layout : BucketLayout
    out : torch.Tensor, optional
        1-D contiguous buffer with at least ``layout.total_numel`` elements, not sharing memory
        with `tensors`; entries past ``total_numel`` are left alone. Allocated when None.
    scale : torch.Tensor, optional
        (n_segments,) float32 on ``layout.device``: per-segment factor, e.g.
        ``layout.inverse_coverage`` (1/c_j). None: a plain copy (bit-exact for equal dtypes).
    out_dtype : torch.dtype, optional
        dtype of the allocated `out` (e.g. torch.bfloat16 to halve the bytes sent); default the
        tensors' dtype. Must equal ``out.dtype`` if both are given.
    partials : torch.Tensor, optional
        (layout.num_norm_partials,) float32 on ``layout.device``, overwritten so that its sum is
        the squared norm of the held slices as read (unscaled), over the segments with
        ``in_norm`` (`SegmentSpec`): `squared_norm` fused into the same launch. Sum the partials
        of many buckets with one ``sum()``.
    backend : {"auto", "triton", "reference"}
        See `kernels.dispatch`.

    Returns
    -------
    torch.Tensor
        `out`.

    Examples
    --------
    >>> import torch
    >>> from kernels import BucketLayout, SegmentSpec, pack
    >>> w = torch.arange(6.0).reshape(3, 2)
    >>> layout = BucketLayout([w.shape], [SegmentSpec(0, "rows", (2, 0), coverage=2)])
    >>> pack([w], layout, scale=layout.inverse_coverage, backend="reference")
    tensor([2.0000, 2.5000, 0.0000, 0.5000])
    """
    impl = select_backend(backend, layout.device)
    return impl.pack(tensors, layout, out, scale=scale, out_dtype=out_dtype, partials=partials)


def unpack(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    *,
    mode: str = "copy",
    scale: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Scatter a packed buffer back into the held slices of the bucket's tensors, in one pass.

    Entries no segment holds are left untouched; ``unpack(pack(ts, layout), ts, layout)`` is the
    identity on the held slices.

    Parameters
    ----------
    buffer : torch.Tensor
        1-D contiguous, at least ``layout.total_numel`` elements, any supported dtype.
    tensors : sequence of torch.Tensor
        Destinations, checked as in `pack`; written in place.
    layout : BucketLayout
    mode : {"copy", "accumulate"}
        ``copy``: ``held = buffer * scale``. ``accumulate``: ``held = held + buffer * scale``,
        computed in float32 and rounded once (no atomics: each element has one writer).
    scale : torch.Tensor, optional
        (n_segments,) float32 per-segment factor, as in `pack`; None for 1.
    partials : torch.Tensor, optional
        (layout.num_norm_partials,) float32 on ``layout.device``, overwritten so that its sum is
        the squared norm of the held slices as written (segments with ``in_norm``):
        `squared_norm` of the result, fused into the same launch (after an averaging all-reduce,
        the averaged gradient's share of a clipping norm).
    backend : {"auto", "triton", "reference"}
    """
    impl = select_backend(backend, layout.device)
    impl.unpack(buffer, tensors, layout, mode=mode, scale=scale, partials=partials)


def squared_norm(tensors: Sequence[torch.Tensor], layout: BucketLayout, *, partials: torch.Tensor | None = None,
                 backend: str = "auto") -> torch.Tensor:
    """Sum of squares, in float32, of every held slice of the bucket's tensors, read in place
    (of the segments with ``in_norm``, `SegmentSpec`).

    What a gradient-clipping norm needs from a bucket, without packing it first (a single-holder
    bucket) or reading its buffer again (after `unpack` the held slices are the averages). The
    Triton backend sums one partial per tile and then the partials, so the result is
    deterministic; it may differ from the reference's order of summation by float32 rounding.
    Nothing waits for the device: the result stays there (see `clip_coefficient`).

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        The bucket's tensors, checked as in `pack`.
    layout : BucketLayout
    partials : torch.Tensor, optional
        (layout.num_norm_partials,) float32 on ``layout.device``: write the per-tile partial
        sums there (their sum is the result) and return it, with no separate sum launched, so
        that the partials of every bucket, slices of one tensor, are summed once per step.
    backend : {"auto", "triton", "reference"}

    Returns
    -------
    torch.Tensor
        0-d float32 on ``layout.device``; `partials` when given.

    Examples
    --------
    >>> import torch
    >>> from kernels import BucketLayout, SegmentSpec, squared_norm
    >>> w = torch.arange(6.0).reshape(3, 2)
    >>> layout = BucketLayout([w.shape], [SegmentSpec(0, "rows", (2, 0))])
    >>> squared_norm([w], layout, backend="reference")
    tensor(42.)
    """
    impl = select_backend(backend, layout.device)
    return impl.squared_norm(tensors, layout, partials=partials)


def overlap_average(
    tensors: Sequence[torch.Tensor],
    layout: BucketLayout,
    all_reduce_fn: Callable[[torch.Tensor], object],
    *,
    buffer: torch.Tensor | None = None,
    buffer_dtype: torch.dtype | None = None,
    divide: str = "before",
    backend: str = "auto",
) -> torch.Tensor:
    """Replace every held slice by its holders' average: pack, sum among holders, unpack.

    With ``divide="before"`` (default) segment j is packed times 1/c_j and `all_reduce_fn` sums,
    so the buffer never holds more than an average; this is what DDP's default hook does and it
    keeps float16/bfloat16 buffers far from overflow. ``divide="after"`` packs raw values and
    divides by c_j while unpacking (the sum is exact in float32 buffers; one rounding less).

    Parameters
    ----------
    tensors : sequence of torch.Tensor
        The bucket's gradients, overwritten with the averages.
    layout : BucketLayout
        Its segments' coverage c_j must equal the number of ranks whose buffers `all_reduce_fn`
        sums for that segment.
    all_reduce_fn : callable
        Called once as ``all_reduce_fn(buffer[:layout.total_numel])``; must sum in place, e.g.
        ``lambda b: dist.all_reduce(b, group=holder_group)``.
    buffer : torch.Tensor, optional
        Preallocated flat buffer (see `pack`'s ``out``); allocated when None.
    buffer_dtype : torch.dtype, optional
        dtype of an allocated buffer, e.g. torch.bfloat16 to halve the bytes sent.
    divide : {"before", "after"}
    backend : {"auto", "triton", "reference"}

    Returns
    -------
    torch.Tensor
        The buffer, holding what `all_reduce_fn` left in it.
    """
    impl = select_backend(backend, layout.device)
    return impl.overlap_average(tensors, layout, all_reduce_fn, buffer=buffer, buffer_dtype=buffer_dtype, divide=divide)
