"""Bytes on the wire: what one rank sends for a collective, under a stated algorithm model.

Every byte counter in the runtime keeps two numbers per collective (see `ByteCount`):

- *buffer bytes*: the size ``n`` of the buffer the collective works on (for an all-gather its
  unsharded output, for a reduce-scatter its unsharded input). This is what ``comm_bytes`` and
  ``comm_bytes_per_step`` in ``metrics.jsonl`` / ``summary.json`` have always reported.
- *wire bytes*: the bytes one rank of the ``c``-rank group sends, under `WIRE_MODEL`:

  ==================  ==========================  ===============================================
  collective          wire bytes per rank         why
  ==================  ==========================  ===============================================
  all_reduce          2 (c - 1) / c * n           ring: a reduce-scatter, then an all-gather
  all_gather          (c - 1) / c * n             ring: every rank forwards c - 1 shards of n / c
  reduce_scatter      (c - 1) / c * n             ring: the same, reducing on the way
  broadcast           (c - 1) / c * n             every non-root receives n once, in any tree or
                                                  chain: (c - 1) n in all, averaged over c ranks
  ==================  ==========================  ===============================================

  A group of one rank sends nothing. For the broadcast the figure is the group's mean (the root
  of a chain sends n, its last rank nothing); for the ring collectives every rank sends exactly
  that much. NCCL's tree all-reduce and gloo's own algorithms may send other amounts; the model
  is what makes DDP, FSDP and SDP comparable on one scale.

Not here: counting itself (`sdp_train.parallel.sync`, `sdp_train.trainer.train` own the counters) or predicting
a run's bytes (`sdp_train.planning.comm`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sdp_train.errors import ConfigError

WIRE_MODEL = ("ring all-reduce 2(c-1)/c*n per rank; ring all-gather and reduce-scatter (c-1)/c*n; "
              "broadcast (c-1)/c*n (each non-root receives n once; mean over the group); "
              "n = buffer bytes, c = ranks in the group")
"""The algorithm model of every ``wire_bytes`` figure, as written into summary.json."""

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def wire_bytes(collective: str, buffer_bytes: int, ranks: int) -> float:
    """Bytes one rank sends for `collective` of a `buffer_bytes` buffer among `ranks` ranks.

    >>> wire_bytes("all_reduce", 1000, 4), wire_bytes("all_gather", 1000, 4), wire_bytes("broadcast", 1000, 1)
    (1500.0, 750.0, 0.0)
    """
    if collective not in COLLECTIVES:
        raise ConfigError(f"collective {collective!r} is not one of {COLLECTIVES}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ConfigError(f"ranks must be an int >= 1, got {ranks!r}")
    share = (ranks - 1) / ranks
    return float((2 * share if collective == "all_reduce" else share) * buffer_bytes)


@dataclass
class ByteCount:
    """Running buffer and wire bytes of the collectives one rank took part in."""

    buffer: int = 0
    wire: float = 0.0

    def add(self, collective: str, buffer_bytes: int, ranks: int) -> None:
        self.buffer += buffer_bytes
        self.wire += wire_bytes(collective, buffer_bytes, ranks)

    def __iadd__(self, other: ByteCount) -> ByteCount:
        self.buffer += other.buffer
        self.wire += other.wire
        return self
