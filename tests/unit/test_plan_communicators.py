"""`sdp plan --device cuda` counts the NCCL communicators as the runtime configures them.

By default the runtime lets split communicators share the world's resources
(NCCL_COMM_SPLIT_SHARE_RESOURCES=1, `sdp_train.parallel.dist.share_split_resources`): a rank then
pays for the world's communicator and for the connections to the ring neighbours its groups add,
not for a communicator per group. With ``=0`` every group is a communicator of its own
(tests/unit/test_plan.py). The figures are estimates (docs/plan.md); the env variables replace them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_train.cli import main
from sdp_train.errors import ConfigError
from sdp_train.planning.communicators import rank_communicators, ring_neighbours
from sdp_train.planning.memory import communicator_share, predict

LLAMA = {"batch_size": 2, "seq_len": 16}
MiB = 2**20


@st.composite
def groups_of_a_world(draw):
    workers = draw(st.integers(2, 12))
    sets = st.lists(st.integers(0, workers - 1), min_size=1, max_size=workers, unique=True).map(lambda s: tuple(sorted(s)))
    return workers, draw(st.lists(sets, max_size=20, unique=True))


@settings(max_examples=50, deadline=None)
@given(world=groups_of_a_world())
def test_shared_communicators_cost_at_most_the_unshared_and_at_most_every_peer_once(world):
    workers, groups = world
    for rank in range(workers):
        shared = rank_communicators(rank, workers, groups, per_communicator=688, per_peer=144, shared=True)
        apart = rank_communicators(rank, workers, groups, per_communicator=688, per_peer=144, shared=False)
        assert shared.count == apart.count == 1 + sum(rank in g for g in groups)
        assert shared.bytes <= apart.bytes
        known = ring_neighbours(range(workers), rank)
        assert shared.new_peers <= min(workers - 1 - len(known), 2 * (shared.count - 1))


def test_a_cuda_plan_counts_the_worlds_communicator_and_each_new_ring_neighbour(monkeypatch):
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "100MiB")
    monkeypatch.setenv("SDP_NCCL_PEER_BYTES", "10MiB")
    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)  # the runtime's default: shared
    cpu = predict("llama-debug", mode="bsdp", workers=6, active=0.5, **LLAMA)
    cuda = predict("llama-debug", mode="bsdp", workers=6, active=0.5, device="cuda", **LLAMA)
    assert cuda["communicators_shared"] and cuda["communicator_count"] > 1
    assert cuda["communicators"] == 100 * MiB + cuda["communicator_peers"] * 10 * MiB
    assert cuda["total"] - cpu["total"] == cuda["communicators"]
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "0")
    apart = predict("llama-debug", mode="bsdp", workers=6, active=0.5, device="cuda", **LLAMA)
    assert not apart["communicators_shared"]
    assert apart["communicators"] == apart["communicator_count"] * 100 * MiB > cuda["communicators"]
    monkeypatch.setenv("SDP_NCCL_PEER_BYTES", "many")
    with pytest.raises(ConfigError, match="SDP_NCCL_PEER_BYTES: memory size 'many'"):
        predict("llama-debug", mode="bsdp", workers=6, active=0.5, device="cuda", **LLAMA)


@pytest.mark.parametrize("mode", ["bsdp", "nsdp"])
def test_llama_1b_on_8_gpus_communicators_take_at_most_a_quarter_of_what_c_half_saves(monkeypatch, mode):
    # issue 27: one communicator per group took 58% (B-SDP) and 87% (N-SDP) of the saving
    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)
    for env in ("SDP_NCCL_COMMUNICATOR_BYTES", "SDP_NCCL_PEER_BYTES"):
        monkeypatch.delenv(env, raising=False)
    ddp = predict("llama-1b", mode="ddp", workers=8, device="cuda")
    row = predict("llama-1b", mode=mode, workers=8, active=0.5, device="cuda")
    share = communicator_share(row, ddp)
    assert share["saved_vs_ddp"] > 0 and share["communicator_share"] <= 0.25
    monkeypatch.setenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", "0")
    apart = predict("llama-1b", mode=mode, workers=8, active=0.5, device="cuda")
    assert communicator_share(apart, ddp)["communicator_share"] > 0.5


def test_cli_prints_the_saving_against_ddp_and_the_communicators_share_of_it(capsys, monkeypatch):
    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)
    monkeypatch.setenv("SDP_NCCL_COMMUNICATOR_BYTES", "1MiB")
    monkeypatch.setenv("SDP_NCCL_PEER_BYTES", "1KiB")
    assert main(["plan", "--model", "llama-debug", "--workers", "6", "--memory-per-device", "2GiB", "--device", "cuda",
                 "--batch-size", "2", "--seq-len", "16", "--active", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].rstrip().endswith("saved vs DDP  comms of it  fits")
    row = predict("llama-debug", mode="bsdp", workers=6, active=0.5, device="cuda", **LLAMA)
    ddp = predict("llama-debug", mode="ddp", workers=6, device="cuda", **LLAMA)
    share = communicator_share(row, ddp)
    bsdp = next(line for line in lines if line.startswith("B-SDP ")).split()
    assert bsdp[-2] == f"{share['communicator_share']:.0%}"  # then fits
    assert any("per ring neighbour its groups add" in line for line in lines)


def test_a_cyclic_design_adds_at_most_two_ring_neighbours_and_the_cli_plans_it(monkeypatch, capsys):
    """Issue 27: the communicators as a share of what SDP saves, the world's counted too. The auto design's
    holder sets are spread over the ranks (each adds ring neighbours); ``--construction cyclic`` takes
    consecutive ranks, whose rings run along the world's: at most 2 new neighbours per rank."""
    monkeypatch.delenv("NCCL_COMM_SPLIT_SHARE_RESOURCES", raising=False)
    for env in ("SDP_NCCL_COMMUNICATOR_BYTES", "SDP_NCCL_PEER_BYTES"):
        monkeypatch.delenv(env, raising=False)
    ddp = predict("llama-1b", mode="ddp", workers=8, device="cuda")
    rows = {c: predict("llama-1b", mode="nsdp", workers=8, active=0.5, device="cuda", construction=c)
            for c in ("auto", "cyclic")}
    assert rows["cyclic"]["communicator_peers"] <= 2 < rows["auto"]["communicator_peers"]
    for row in rows.values():  # the same saving: the held bytes do not depend on which ranks hold a block
        assert communicator_share(row, ddp)["saved_vs_ddp"] == communicator_share(rows["auto"], ddp)["saved_vs_ddp"]
    cyclic = communicator_share(rows["cyclic"], ddp)
    assert rows["cyclic"]["communicators"] / cyclic["saved_vs_ddp"] <= 0.25  # the world's communicator included
    assert main(["plan", "--model", "llama-debug", "--workers", "6", "--memory-per-device", "2GiB", "--device", "cuda",
                 "--batch-size", "2", "--seq-len", "16", "--active", "0.5", "--construction", "cyclic", "--json"]) == 0
    import json

    planned = {r["system"]: r for r in json.loads(capsys.readouterr().out)}
    want = predict("llama-debug", mode="bsdp", workers=6, active=0.5, device="cuda", construction="cyclic", **LLAMA)
    assert planned["B-SDP"]["communicator_peers"] == want["communicator_peers"]
    assert main(["plan", "--model", "llama-debug", "--workers", "4", "--budgets", "1GiB,1GiB,1GiB,1GiB",
                 "--construction", "cyclic"]) == 2
    assert "--construction cyclic designs the plain plan's masks" in capsys.readouterr().err
