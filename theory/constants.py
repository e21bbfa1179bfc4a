"""Problem constants for `sdp verify`: the worst split of totals, or per-block constants from a file.

The bounds of docs/theory.md are linear in the per-block constants sigma_j^2, zeta_j^2 and G_j^2
with non-negative coefficients. Given only totals (sigma^2 = sum_j sigma_j^2, likewise zeta^2 and
G^2), the largest value the bound takes over every way of splitting them is reached by putting each
total on the block with the largest coefficient (docs/theory.md, Proposition 1): for sigma and zeta
that is a least-covered block in every regime `theory` covers, for G the block maximising
sum_k M_kj rho_k. `worst_case_constants` builds those constants; `load_constants` reads measured
per-block constants from a JSON file (format below). This module evaluates no bound.

Constants file (JSON object, one entry per mask column, in mask order)::

    {
      "format": "sdp-constants",            # required, exactly this string
      "version": 1,                         # required
      "sigma_sq": [0.1, 0.3],               # required: sigma_j^2 per block, finite, >= 0
      "zeta_sq": [0.0, 2.5],                # required: zeta_j^2 per block, finite, >= 0
      "grad_sq": [1.0, 4.0],                # optional: G_j^2 per block (needed for local steps)
      "block_names": ["layer0", "layer1"],  # optional: must equal the mask's block names
      "smoothness": 1.0,                    # optional: L (else --smoothness)
      "worker_smoothness": 1.5,             # optional: L_w >= L (local steps; defaults to L)
      "suboptimality": 5.0                  # optional: f(x_0) - f^* (else --suboptimality)
    }
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from masklab.mask import Mask
from theory.bounds import ProblemConstants, drift_block_weights
from theory.errors import TheoryError

CONSTANTS_FORMAT = "sdp-constants"
CONSTANTS_VERSION = 1
_FIELDS = {"format", "version", "sigma_sq", "zeta_sq", "grad_sq", "block_names", "smoothness",
           "worker_smoothness", "suboptimality"}


def worst_case_blocks(mask: Mask) -> dict[str, int]:
    """The block that receives each total in the worst split: {"sigma": j, "zeta": j, "grad": j}.

    >>> worst_case_blocks(Mask([[1, 1, 0], [1, 0, 1], [1, 1, 1]]))
    {'sigma': 1, 'zeta': 1, 'grad': 0}
    """
    least = int(np.argmin(mask.coverage))
    return {"sigma": least, "zeta": least, "grad": int(np.argmax(drift_block_weights(mask)))}


def worst_case_constants(
    mask: Mask,
    *,
    smoothness: float,
    sigma: float,
    zeta: float,
    suboptimality: float,
    grad_bound: float | None = None,
) -> ProblemConstants:
    """Per-block constants that make every bound of `theory.bounds` largest for the given totals.

    sigma^2 and zeta^2 go to one least-covered block, G^2 to the block maximising
    `drift_block_weights`; every other block gets 0.

    >>> c = worst_case_constants(Mask([[1, 1], [1, 0]]), smoothness=1.0, sigma=2.0, zeta=1.0,
    ...                          suboptimality=1.0)
    >>> c.sigma_sq.tolist(), c.zeta_sq.tolist()
    ([0.0, 4.0], [0.0, 1.0])
    """
    for name, value in (("sigma", sigma), ("zeta", zeta), ("grad_bound", grad_bound)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise TheoryError(f"{name}={value!r} must be a finite number >= 0")
    at = worst_case_blocks(mask)

    def on(block: int, total: float) -> np.ndarray:
        out = np.zeros(mask.blocks)
        out[block] = total**2
        return out

    return ProblemConstants(
        smoothness=smoothness,
        sigma_sq=on(at["sigma"], sigma),
        zeta_sq=on(at["zeta"], zeta),
        suboptimality=suboptimality,
        grad_sq=None if grad_bound is None else on(at["grad"], grad_bound),
    )


def worst_case_split(
    mask: Mask,
    bound_total: Callable[[ProblemConstants], float],
    *,
    smoothness: float,
    sigma: float,
    zeta: float,
    suboptimality: float,
    grad_bound: float | None = None,
) -> ProblemConstants:
    """The worst split of the totals for any bound that is affine in the per-block constants.

    Each total goes to the block whose vertex gives the largest `bound_total` (Proposition 1 holds
    for every affine bound with non-negative coefficients); 3 B + 1 evaluations. Used for Theorem 6,
    whose worst blocks differ from Theorems 1-3's (noise is worst on a most-covered block there).

    >>> from theory.bounds import sdp_bound
    >>> m = Mask([[1, 1], [1, 0]])
    >>> c = worst_case_split(m, lambda c: sdp_bound(m, c, eta=0.5, steps=10).total, smoothness=1.0,
    ...                      sigma=1.0, zeta=1.0, suboptimality=1.0)
    >>> c.zeta_sq.tolist()
    [0.0, 1.0]
    """
    worst = worst_case_constants(mask, smoothness=smoothness, sigma=sigma, zeta=zeta, suboptimality=suboptimality,
                                 grad_bound=grad_bound)
    zero = np.zeros(mask.blocks)
    base = {"sigma_sq": zero, "zeta_sq": zero, "grad_sq": None if grad_bound is None else zero}
    chosen = {}
    for name, total in (("sigma_sq", sigma), ("zeta_sq", zeta), ("grad_sq", grad_bound)):
        if total is None:
            chosen[name] = None
            continue
        values = []
        for j in range(mask.blocks):
            vertex = np.zeros(mask.blocks)
            vertex[j] = total**2
            trial = {**base, name: vertex}
            values.append(bound_total(ProblemConstants(smoothness, trial["sigma_sq"], trial["zeta_sq"],
                                                       suboptimality, grad_sq=trial["grad_sq"])))
        vertex = np.zeros(mask.blocks)
        vertex[int(np.argmax(values))] = total**2
        chosen[name] = vertex
    return ProblemConstants(worst.smoothness, chosen["sigma_sq"], chosen["zeta_sq"], worst.suboptimality,
                            grad_sq=chosen["grad_sq"])


def load_constants(
    path: str | Path,
    mask: Mask,
    *,
    smoothness: float | None = None,
    suboptimality: float | None = None,
) -> ProblemConstants:
    """Read per-block constants for `mask` from a constants file (format in the module docstring).

    `smoothness` and `suboptimality` come from the file or from the arguments; giving both with
    different values is an error, as is giving neither.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TheoryError(f"constants file {str(path)!r}: cannot be read as JSON ({exc})") from None
    where = f"constants file {str(path)!r}"
    if not isinstance(data, dict):
        raise TheoryError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise TheoryError(f"{where}: unknown field {unknown[0]!r} (fields: {sorted(_FIELDS)})")
    if data.get("format") != CONSTANTS_FORMAT:
        raise TheoryError(f"{where}: field 'format' must be {CONSTANTS_FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != CONSTANTS_VERSION:
        raise TheoryError(f"{where}: field 'version' must be {CONSTANTS_VERSION}, got {data.get('version')!r}")
    names = data.get("block_names")
    if names is not None and list(names) != list(mask.block_names):
        raise TheoryError(f"{where}: field 'block_names' {names!r} differs from the mask's {list(mask.block_names)!r}")
    arrays = {name: _per_block(data, name, mask.blocks, where) for name in ("sigma_sq", "zeta_sq", "grad_sq")}
    if arrays["sigma_sq"] is None or arrays["zeta_sq"] is None:
        missing = "sigma_sq" if arrays["sigma_sq"] is None else "zeta_sq"
        raise TheoryError(f"{where}: field {missing!r} is required")
    scalars = {}
    for name, given in (("smoothness", smoothness), ("suboptimality", suboptimality)):
        stored = _scalar(data, name, where)
        if stored is not None and given is not None and stored != given:
            raise TheoryError(f"{where}: field {name!r} = {stored!r} but --{name} {given!r} was given")
        value = stored if stored is not None else given
        if value is None:
            raise TheoryError(f"{where}: field {name!r} is missing and --{name} was not given")
        scalars[name] = value
    return ProblemConstants(
        smoothness=scalars["smoothness"],
        sigma_sq=arrays["sigma_sq"],
        zeta_sq=arrays["zeta_sq"],
        suboptimality=scalars["suboptimality"],
        worker_smoothness=_scalar(data, "worker_smoothness", where),
        grad_sq=arrays["grad_sq"],
    )


def _per_block(data: dict, name: str, blocks: int, where: str) -> np.ndarray | None:
    value = data.get(name)
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value)
    if not ok:
        raise TheoryError(f"{where}: field {name!r} must be a list of finite numbers >= 0, got {value!r}")
    if len(value) != blocks:
        raise TheoryError(f"{where}: field {name!r} has {len(value)} entries but the mask has {blocks} blocks")
    return np.asarray(value, dtype=float)


def _scalar(data: dict, name: str, where: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TheoryError(f"{where}: field {name!r} must be a finite number > 0, got {value!r}")
    return float(value)
