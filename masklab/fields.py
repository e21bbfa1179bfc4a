"""Finite-field arithmetic GF(q) for prime powers q = p^n, as the exact designs need it.

GF(p^n) is GF(p)[x] / (f) for a primitive polynomial f of degree n, found by search, so x itself
generates the multiplicative group. An element is the integer sum_t a_t p^t of its coefficients
a_0 .. a_{n-1} in the polynomial basis; for a prime q this is the residue itself. The field is
stored as add/mul/neg/inv lookup tables (numpy arrays), which is what vectorised incidence
computations want. This module does not build masks (see `masklab.constructions`) and aims at the
small fields of block designs (q up to a few thousand), not at cryptographic sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from masklab.errors import DesignError


def prime_power(q: int) -> tuple[int, int]:
    """(p, n) with q = p^n and p prime.

    Raises
    ------
    DesignError
        If q is not a prime power (1 is not one either).

    Examples
    --------
    >>> prime_power(9), prime_power(8), prime_power(7)
    ((3, 2), (2, 3), (7, 1))
    >>> prime_power(6)
    Traceback (most recent call last):
    ...
    masklab.errors.DesignError: q=6 is not a prime power (6 = 2 * 3); GF(q) exists only for q = p^n
    """
    if isinstance(q, bool) or not isinstance(q, (int, np.integer)):
        raise DesignError(f"field order q={q!r} must be an integer")
    q = int(q)
    if q < 2:
        raise DesignError(f"q={q} is not a prime power; GF(q) needs q >= 2")
    factors = _prime_factors(q)
    primes = sorted(set(factors))
    if len(primes) != 1:
        shown = " * ".join(str(f) for f in factors)
        raise DesignError(f"q={q} is not a prime power ({q} = {shown}); GF(q) exists only for q = p^n")
    return primes[0], len(factors)


def is_prime_power(q: int) -> bool:
    """Whether GF(q) exists, i.e. q = p^n for a prime p and n >= 1.

    >>> [q for q in range(1, 17) if is_prime_power(q)]
    [2, 3, 4, 5, 7, 8, 9, 11, 13, 16]
    """
    try:
        prime_power(q)
    except DesignError:
        return False
    return True


@lru_cache(maxsize=None)
def primitive_polynomial(p: int, n: int) -> tuple[int, ...]:
    """Coefficients (a_0, ..., a_{n-1}) of the first monic primitive x^n + a_{n-1} x^{n-1} + ... + a_0 over GF(p).

    "First" in the order of the integer sum_t a_t p^t, so the choice is fixed. Primitive means x has
    multiplicative order exactly p^n - 1 modulo the polynomial, which also makes it irreducible.

    >>> primitive_polynomial(2, 3), primitive_polynomial(3, 2), primitive_polynomial(7, 1)
    ((1, 1, 0), (2, 1), (2,))
    """
    prime_power(p)  # validates the type and that p >= 2
    if _prime_factors(p) != [p]:
        raise DesignError(f"characteristic p={p} must be prime")
    if n < 1:
        raise DesignError(f"extension degree n={n} must be >= 1")
    order = p**n - 1
    cofactors = [order // r for r in sorted(set(_prime_factors(order)))] if order > 1 else []
    for code in range(1, p**n):
        coeffs = tuple((code // p**t) % p for t in range(n))
        if coeffs[0] == 0:
            continue
        if _x_power(coeffs, p, order) == _one(n) and all(
            _x_power(coeffs, p, e) != _one(n) for e in cofactors
        ):
            return coeffs
    raise AssertionError(f"no primitive polynomial of degree {n} over GF({p})")  # pragma: no cover


@lru_cache(maxsize=None)
def power_digits(p: int, n: int) -> np.ndarray:
    """Coefficient vectors of x^0, x^1, ..., x^(p^n - 2) in GF(p^n), shape (p^n - 1, n), read-only.

    Row i holds (a_0, ..., a_{n-1}) of x^i modulo `primitive_polynomial(p, n)`; the rows run through
    every nonzero element exactly once.

    >>> power_digits(2, 2).tolist()
    [[1, 0], [0, 1], [1, 1]]
    """
    coeffs = primitive_polynomial(p, n)
    reduce_by = [(-a) % p for a in coeffs]  # x^n = -(a_0 + ... + a_{n-1} x^{n-1})
    rows = np.zeros((p**n - 1, n), dtype=np.int64)
    current = list(_one(n))
    for i in range(p**n - 1):
        rows[i] = current
        top = current[-1]
        current = [0, *current[:-1]]
        if top:
            current = [(c + top * r) % p for c, r in zip(current, reduce_by)]
    rows.setflags(write=False)
    return rows


@dataclass(frozen=True, eq=False)
class GaloisField:
    """GF(q) as lookup tables over the elements 0 .. q-1 (0 is zero, 1 is one).

    Attributes
    ----------
    order, characteristic, degree : int
        q, p and n with q = p^n.
    modulus : tuple of int
        Low coefficients of the monic primitive polynomial defining GF(p^n) over GF(p).
    add, mul : ndarray of shape (q, q)
        ``add[a, b]`` = a + b and ``mul[a, b]`` = a * b.
    neg, inv : ndarray of shape (q,)
        ``neg[a]`` = -a; ``inv[a]`` = 1/a for a != 0 (0 has no inverse, ``inv[0]`` is 0).
    primitive_element : int
        A generator of the multiplicative group (the class of x).
    """

    order: int
    characteristic: int
    degree: int
    modulus: tuple[int, ...]
    add: np.ndarray
    mul: np.ndarray
    neg: np.ndarray
    inv: np.ndarray
    primitive_element: int

    def __repr__(self) -> str:
        return f"GaloisField(order={self.order}, characteristic={self.characteristic}, degree={self.degree})"


@lru_cache(maxsize=32)
def galois_field(q: int) -> GaloisField:
    """The finite field GF(q) for a prime power q.

    Raises
    ------
    DesignError
        If q is not a prime power.

    Examples
    --------
    >>> f = galois_field(4)
    >>> int(f.mul[2, 3]), int(f.add[2, 3]), int(f.inv[2])
    (1, 1, 3)
    >>> all(int(f.mul[a, f.inv[a]]) == 1 for a in range(1, 4))
    True
    """
    p, n = prime_power(q)
    q = int(q)
    weights = p ** np.arange(n)
    digits = (np.arange(q)[:, None] // weights) % p  # (q, n) coefficients of each element
    add = ((digits[:, None, :] + digits[None, :, :]) % p) @ weights
    neg = ((-digits) % p) @ weights
    antilog = power_digits(p, n) @ weights  # antilog[i] = x^i
    log = np.zeros(q, dtype=np.int64)
    log[antilog] = np.arange(q - 1)
    mul = np.zeros((q, q), dtype=np.int64)
    mul[1:, 1:] = antilog[(log[1:, None] + log[None, 1:]) % (q - 1)]
    inv = np.zeros(q, dtype=np.int64)
    inv[1:] = antilog[(-log[1:]) % (q - 1)]
    for table in (add, mul, neg, inv):
        table.setflags(write=False)
    return GaloisField(q, p, n, primitive_polynomial(p, n), add, mul, neg, inv, int(antilog[1 % (q - 1)]))


# -- internals ---------------------------------------------------------------------------------
def _prime_factors(n: int) -> list[int]:
    """Prime factors of n >= 2 with multiplicity, ascending (trial division: n is small here)."""
    factors = []
    d = 2
    while d * d <= n:
        while n % d == 0:
            factors.append(d)
            n //= d
        d += 1
    if n > 1:
        factors.append(n)
    return factors


def _one(n: int) -> tuple[int, ...]:
    return (1,) + (0,) * (n - 1)


def _mulmod(a: tuple[int, ...], b: tuple[int, ...], modulus: tuple[int, ...], p: int) -> tuple[int, ...]:
    """a * b modulo the monic polynomial x^n + sum_t modulus[t] x^t, all over GF(p)."""
    n = len(modulus)
    prod = [0] * (2 * n - 1)
    for i, ai in enumerate(a):
        if ai:
            for j, bj in enumerate(b):
                prod[i + j] = (prod[i + j] + ai * bj) % p
    for d in range(2 * n - 2, n - 1, -1):
        top = prod[d]
        if top:
            for t, m in enumerate(modulus):
                prod[d - n + t] = (prod[d - n + t] - top * m) % p
    return tuple(prod[:n])


def _x_power(modulus: tuple[int, ...], p: int, e: int) -> tuple[int, ...]:
    """x^e modulo the monic polynomial given by `modulus`, by square-and-multiply."""
    n = len(modulus)
    base = (0, 1) + (0,) * (n - 2) if n > 1 else ((-modulus[0]) % p,)
    result = _one(n)
    while e:
        if e & 1:
            result = _mulmod(result, base, modulus, p)
        base = _mulmod(base, base, modulus, p)
        e >>= 1
    return result
