"""Finite fields GF(q): exhaustive axiom checks for small q, and the prime-power rule."""

from __future__ import annotations

import numpy as np
import pytest

from masklab.errors import DesignError
from masklab.fields import galois_field, is_prime_power, power_digits, prime_power, primitive_polynomial

SMALL_FIELDS = [2, 3, 4, 5, 7, 8, 9, 16, 25, 27]


@pytest.mark.parametrize("q", SMALL_FIELDS)
def test_field_axioms_hold_for_every_triple(q: int) -> None:
    f = galois_field(q)
    add, mul = f.add, f.mul
    a, b, c = np.meshgrid(np.arange(q), np.arange(q), np.arange(q), indexing="ij")
    assert np.array_equal(add[add[a, b], c], add[a, add[b, c]])
    assert np.array_equal(mul[mul[a, b], c], mul[a, mul[b, c]])
    assert np.array_equal(mul[a, add[b, c]], add[mul[a, b], mul[a, c]])
    assert np.array_equal(add, add.T) and np.array_equal(mul, mul.T)
    elements = np.arange(q)
    assert np.array_equal(add[0], elements) and np.array_equal(mul[1], elements)
    assert np.all(mul[0] == 0)
    assert np.all(add[elements, f.neg] == 0)
    assert np.all(mul[elements[1:], f.inv[1:]] == 1)


@pytest.mark.parametrize("q", SMALL_FIELDS)
def test_adding_one_characteristic_times_gives_zero(q: int) -> None:
    f = galois_field(q)
    total = 0
    for _ in range(f.characteristic):
        total = int(f.add[total, 1])
    assert total == 0
    assert f.characteristic ** f.degree == q


@pytest.mark.parametrize("q", SMALL_FIELDS)
def test_primitive_element_generates_every_nonzero_element(q: int) -> None:
    f = galois_field(q)
    seen, x = set(), 1
    for _ in range(q - 1):
        seen.add(x)
        x = int(f.mul[x, f.primitive_element])
    assert x == 1 and seen == set(range(1, q))


@pytest.mark.parametrize(("p", "n"), [(2, 1), (2, 4), (3, 3), (5, 2), (2, 9)])
def test_power_digits_visit_every_nonzero_element_once(p: int, n: int) -> None:
    rows = power_digits(p, n) @ (p ** np.arange(n))
    assert sorted(rows.tolist()) == list(range(1, p**n))
    assert len(primitive_polynomial(p, n)) == n


@pytest.mark.parametrize(("q", "expected"), [(2, (2, 1)), (4, (2, 2)), (8, (2, 3)), (9, (3, 2)), (49, (7, 2)), (13, (13, 1))])
def test_prime_power_factors_q(q: int, expected: tuple[int, int]) -> None:
    assert prime_power(q) == expected
    assert is_prime_power(q)


@pytest.mark.parametrize("q", [6, 10, 12, 1, 0, -4])
def test_non_prime_powers_raise_naming_q(q: int) -> None:
    assert not is_prime_power(q)
    with pytest.raises(DesignError, match=f"q={q}"):
        galois_field(q)


@pytest.mark.parametrize("q", [2.0, "4", True])
def test_non_integer_order_raises(q: object) -> None:
    with pytest.raises(DesignError, match="must be an integer"):
        prime_power(q)  # type: ignore[arg-type]
