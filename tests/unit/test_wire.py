"""The wire model: bytes one rank sends per collective (ring all-reduce, all-gather, reduce-scatter, broadcast)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdp_train.parallel.wire import WIRE_MODEL, ByteCount, wire_bytes


@pytest.mark.parametrize(("collective", "ranks", "expected"), [
    ("all_reduce", 2, 1000), ("all_reduce", 4, 1500), ("all_gather", 4, 750), ("reduce_scatter", 8, 875),
    ("broadcast", 4, 750), ("all_reduce", 1, 0), ("broadcast", 1, 0),
])
def test_wire_bytes_closed_forms(collective, ranks, expected):
    assert wire_bytes(collective, 1000, ranks) == pytest.approx(expected)


@given(n=st.integers(0, 2**40), c=st.integers(1, 4096))
def test_an_all_reduce_sends_what_a_reduce_scatter_and_an_all_gather_send_together_and_less_than_2n(n, c):
    ar = wire_bytes("all_reduce", n, c)
    assert ar == pytest.approx(wire_bytes("reduce_scatter", n, c) + wire_bytes("all_gather", n, c))
    assert 0 <= ar <= 2 * n


def test_fsdp_sends_about_one_and_a_half_times_ddp_not_three():
    """The issue's table: per step FSDP gathers twice and reduce-scatters once, DDP all-reduces once."""
    n, c = 10**6, 4
    ddp, fsdp = ByteCount(), ByteCount()
    ddp.add("all_reduce", n, c)
    for collective in ("all_gather", "all_gather", "reduce_scatter"):
        fsdp.add(collective, n, c)
    assert fsdp.buffer / ddp.buffer == 3
    assert fsdp.wire / ddp.wire == pytest.approx(1.5)


def test_bad_collective_or_group_size_is_refused_naming_it():
    with pytest.raises(ValueError, match="'gather' is not one of"):
        wire_bytes("gather", 1, 2)
    with pytest.raises(ValueError, match="ranks must be an int >= 1, got 0"):
        wire_bytes("all_reduce", 1, 0)
    assert "2(c-1)/c" in WIRE_MODEL
