"""Device memory of the NCCL communicators one rank holds, as the runtime configures them.

A rank holds the world's communicator and one per process group it is in
(`sdp_train.planning.comm.process_group_holder_sets`). Without resource sharing each is a
communicator of its own, `NCCL_COMMUNICATOR_BYTES` each (`sdp_train.planning.memory`). With
``NCCL_COMM_SPLIT_SHARE_RESOURCES=1``, the runtime's default on CUDA
(`sdp_train.parallel.dist.share_split_resources`), a group's communicator is split from the world's
and reuses its streams, proxy and per-peer connection buffers (NCCL's ``sharedRes``): it costs only
the connections to ring neighbours the rank has in no communicator yet. The world's then counts
`NCCL_COMMUNICATOR_BYTES` and each new neighbour `NCCL_PEER_BYTES`. Both are estimates from
published measurements, overridden by ``SDP_NCCL_COMMUNICATOR_BYTES`` and ``SDP_NCCL_PEER_BYTES``
(`sdp_train.planning.memory.communicator_bytes` and ``peer_bytes`` read them); docs/plan.md gives
the sources and `scripts/gpu_check.sh` measures a machine's.

Not here: which groups a run creates (`sdp_train.planning.comm`), or host memory (gloo: 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NCCL_PEER_BYTES = 144 * 2**20
"""Device memory of one more ring neighbour's connections, an estimate: NCCL allocates each peer
connection's buffers per channel, and on 4 A100s with NVLink a 2-rank communicator (one neighbour)
took 544 MiB, a 3- or 4-rank one (two neighbours) 688 MiB (NVIDIA/nccl#964): 144 MiB a neighbour.
Set ``SDP_NCCL_PEER_BYTES`` to what a machine measures."""
PEER_BYTES_ENV = "SDP_NCCL_PEER_BYTES"


@dataclass(frozen=True)
class RankCommunicators:
    """What one rank's communicators cost: `count` communicators, `new_peers` ring neighbours beyond
    the world's (counted with sharing only), `bytes` in all."""

    count: int
    new_peers: int
    bytes: int


def ring_neighbours(holders: Sequence[int], rank: int) -> set[int]:
    """The ranks next to `rank` in the ring of the group `holders` (its ranks in order, as NCCL's ring
    search orders the GPUs of one NVSwitch node; elsewhere an estimate); empty if it is not a member.

    >>> sorted(ring_neighbours((0, 2, 5, 7), 0)), sorted(ring_neighbours((3, 4), 3)), ring_neighbours((1,), 1)
    ([2, 7], [4], set())
    """
    members = sorted(holders)
    if rank not in members or len(members) < 2:
        return set()
    i = members.index(rank)
    return {members[i - 1], members[(i + 1) % len(members)]}


def rank_communicators(rank: int, workers: int, groups: Sequence[Sequence[int]], *, per_communicator: int,
                       per_peer: int, shared: bool) -> RankCommunicators:
    """The communicators of `rank` in a `workers`-rank run whose process groups are `groups`.

    Unshared: 1 + (the groups it is in), `per_communicator` each. Shared: the world's at
    `per_communicator`, and `per_peer` for every ring neighbour its groups add to the world's.
    One rank has no communicator.

    >>> groups = [(0, 1), (0, 2), (1, 2)]
    >>> rank_communicators(0, 3, groups, per_communicator=10, per_peer=1, shared=False)
    RankCommunicators(count=3, new_peers=0, bytes=30)
    >>> rank_communicators(0, 4, [(0, 2), (0, 1, 3)], per_communicator=10, per_peer=1, shared=True)
    RankCommunicators(count=3, new_peers=1, bytes=11)
    """
    if workers == 1:
        return RankCommunicators(0, 0, 0)
    mine = [g for g in groups if rank in g]
    if not shared:
        return RankCommunicators(1 + len(mine), 0, (1 + len(mine)) * per_communicator)
    known = ring_neighbours(range(workers), rank)
    new = set().union(*(ring_neighbours(g, rank) for g in mine)) - known if mine else set()
    return RankCommunicators(1 + len(mine), len(new), per_communicator + len(new) * per_peer)
