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
      "suboptimality": 5.0,                 # optional: f(x_0) - f^* (else --suboptimality)
      "shared": {"sigma_sq": 0.9, "zeta_sq": 0.1, "grad_sq": 2.0, "parameters": 66000},
                                            # optional: parameters every worker holds, one more column
                                            # of coverage K (grad_sq iff the columns have it; parameters
                                            # iff the mask has block sizes)
      "estimate": {...}                     # optional: the constants are estimates (how, and what that
                                            # assumes); `sdp estimate` writes it
    }

`load_constants_file` returns the mask with the shared column appended (`with_shared_column`) beside
the constants; `load_constants` returns the constants alone and refuses a file with a shared column.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from masklab.mask import Mask
from theory.bounds import ProblemConstants, drift_block_weights
from theory.errors import TheoryError

CONSTANTS_FORMAT = "sdp-constants"
CONSTANTS_VERSION = 1
_FIELDS = {"format", "version", "sigma_sq", "zeta_sq", "grad_sq", "block_names", "smoothness",
           "worker_smoothness", "suboptimality", "shared", "estimate"}
_SHARED_FIELDS = {"sigma_sq", "zeta_sq", "grad_sq", "parameters"}
SHARED_COLUMN = "shared"


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


@dataclass(frozen=True, eq=False)
class ConstantsFile:
    """A constants file read for a mask: the mask the constants are for, the constants, how they were made."""

    mask: Mask
    """The given mask, with the ``shared`` column appended when the file has one (`with_shared_column`)."""
    constants: ProblemConstants
    estimate: dict | None
    """The file's ``estimate`` object (how the constants were estimated, and what that assumes), or None."""

    @property
    def estimated(self) -> bool:
        """Whether the constants are estimates (then no bound evaluated at them is proved for the run)."""
        return self.estimate is not None


def with_shared_column(mask: Mask, *, parameters: int | None = None) -> Mask:
    """`mask` with one more column, ``shared``, held by every worker in every round (coverage K).

    The parameters no block owns (embeddings, head, final norm) are such a column: they enter every
    bound like DDP's. ``parameters`` is its size, required when `mask` records block sizes.

    >>> with_shared_column(Mask([[1, 0], [0, 1]])).coverage.tolist()
    [1, 1, 2]
    """
    if SHARED_COLUMN in mask.block_names:
        raise TheoryError(f"the mask already has a block named {SHARED_COLUMN!r}; the shared column needs that name")
    sizes = None
    if mask.block_sizes is not None:
        if parameters is None:
            raise TheoryError("the mask records block sizes: the shared column needs its 'parameters'")
        sizes = (*mask.block_sizes, parameters)

    def widen(m: np.ndarray) -> np.ndarray:
        return np.concatenate([m, np.ones((m.shape[0], 1), dtype=m.dtype)], axis=1)

    rounds = None if mask.rounds is None else [widen(m) for m in mask.rounds]
    return Mask(widen(mask.matrix), block_names=(*mask.block_names, SHARED_COLUMN), block_sizes=sizes,
                schedule=mask.schedule, construction=mask.construction, rounds=rounds)


def load_constants(
    path: str | Path,
    mask: Mask,
    *,
    smoothness: float | None = None,
    suboptimality: float | None = None,
) -> ProblemConstants:
    """Read per-block constants for `mask` from a constants file (format in the module docstring).

    `smoothness` and `suboptimality` come from the file or from the arguments; giving both with
    different values is an error, as is giving neither. A file with a ``shared`` column is refused:
    its constants are for a wider mask (`load_constants_file`).
    """
    loaded = load_constants_file(path, mask, smoothness=smoothness, suboptimality=suboptimality)
    if loaded.mask.blocks != mask.blocks:
        raise TheoryError(f"constants file {str(path)!r}: has a 'shared' column, which the mask lacks; read it "
                          "with load_constants_file, which appends the column to the mask")
    return loaded.constants


def load_constants_file(
    path: str | Path,
    mask: Mask,
    *,
    smoothness: float | None = None,
    suboptimality: float | None = None,
) -> ConstantsFile:
    """Read a constants file for `mask`: the constants, the mask they are for (with a ``shared`` column
    if the file has one) and the file's ``estimate`` object. Errors as `load_constants`."""
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
    estimate = data.get("estimate")
    if estimate is not None and not isinstance(estimate, dict):
        raise TheoryError(f"{where}: field 'estimate' must be a JSON object, got {estimate!r}")
    if data.get("shared") is not None:
        mask, arrays = _with_shared(data["shared"], mask, arrays, where)
    scalars = {}
    for name, given in (("smoothness", smoothness), ("suboptimality", suboptimality)):
        stored = _scalar(data, name, where)
        if stored is not None and given is not None and stored != given:
            raise TheoryError(f"{where}: field {name!r} = {stored!r} but --{name} {given!r} was given")
        value = stored if stored is not None else given
        if value is None:
            raise TheoryError(f"{where}: field {name!r} is missing and --{name} was not given")
        scalars[name] = value
    constants = ProblemConstants(
        smoothness=scalars["smoothness"],
        sigma_sq=arrays["sigma_sq"],
        zeta_sq=arrays["zeta_sq"],
        suboptimality=scalars["suboptimality"],
        worker_smoothness=_scalar(data, "worker_smoothness", where),
        grad_sq=arrays["grad_sq"],
    )
    return ConstantsFile(mask=mask, constants=constants, estimate=estimate)


def _with_shared(shared: object, mask: Mask, arrays: dict, where: str) -> tuple[Mask, dict]:
    """The mask and per-block arrays with the file's ``shared`` column appended."""
    if not isinstance(shared, dict):
        raise TheoryError(f"{where}: field 'shared' must be a JSON object, got {shared!r}")
    unknown = sorted(set(shared) - _SHARED_FIELDS)
    if unknown:
        raise TheoryError(f"{where}: unknown field 'shared.{unknown[0]}' (fields: {sorted(_SHARED_FIELDS)})")
    wanted = ["sigma_sq", "zeta_sq"] + (["grad_sq"] if arrays["grad_sq"] is not None else [])
    for name in ("sigma_sq", "zeta_sq", "grad_sq"):
        if (name in wanted) != (name in shared):
            raise TheoryError(f"{where}: field 'shared.{name}' " + ("is required" if name in wanted else
                              "is given but the columns have no 'grad_sq'"))
    for name in wanted:
        value = shared[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise TheoryError(f"{where}: field 'shared.{name}' must be a finite number >= 0, got {value!r}")
    parameters = shared.get("parameters")
    if parameters is not None and (isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 1):
        raise TheoryError(f"{where}: field 'shared.parameters' must be an integer >= 1, got {parameters!r}")
    if mask.block_sizes is not None and parameters is None:
        raise TheoryError(f"{where}: field 'shared.parameters' is required: the mask records block sizes")
    wide = with_shared_column(mask, parameters=parameters if mask.block_sizes is not None else None)
    return wide, {name: None if arrays[name] is None else np.append(arrays[name], float(shared[name]))
                  for name in arrays}


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
