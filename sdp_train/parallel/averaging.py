"""Value averaging among holders: every tensor slice of a bucket becomes its holders' mean.

One implementation for both regimes that average values rather than gradients: local steps with
forward masking (`SubnetworkDataParallel(..., local_steps=H)`, over the sync engine's buckets) and
overlap averaging (`OverlapAveraging`, over its round's buckets). Each bucket is one
``kernels.overlap_average`` (pack scaled by 1/c_j, one all-reduce among the holders, unpack).
Not here: gradient averaging during backward (`sdp_train.parallel.sync.SyncEngine`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

import kernels
from sdp_train.parallel.dist import wait
from sdp_train.parallel.wire import ByteCount


@torch.no_grad()
def average_values(buckets: Iterable, counter: ByteCount | None = None, *,
                   copies: bool = False) -> dict[int, torch.Tensor]:
    """Replace the tensors of every communicating bucket (`sdp_train.parallel.sync`'s ``_Bucket``)
    by their holders' average, in place or, with `copies`, on clones; returned by tensor id.

    Every holder of each bucket must call it with the buckets in the same (global) order. The
    bucket's buffer is used when it has the tensors' dtype (a ``comm_dtype`` buffer is for
    gradients and would round the values). `counter`, when given, counts the all-reduces' bytes.
    """
    out: dict[int, torch.Tensor] = {}
    for bucket in buckets:
        if not bucket.communicates:
            continue
        values = [t.detach().clone() if copies else t.data for t in bucket.params]
        own_dtype = bucket.buffer.dtype == bucket.params[0].dtype
        buffer = kernels.overlap_average(values, bucket.layout,
                                         lambda b, g=bucket.group: wait(dist.all_reduce(b, group=g, async_op=True),
                                                                        b.device),
                                         buffer=bucket.buffer if own_dtype else None)
        if counter is not None:
            counter.add("all_reduce", bucket.layout.total_numel * buffer.element_size(), len(bucket.plan.holders))
        out.update({id(t): v for t, v in zip(bucket.params, values)})
    return out
