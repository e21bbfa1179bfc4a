"""Save and load masks and block costs as versioned JSON: ``{"format": "sdp-mask" | "sdp-costs", ...}``.

Rows are stored as strings of '0'/'1' (one per worker), which keeps a K = 1024, B = 4096 mask at
about 4 MB and diff-able. A costs file holds the bytes of each block (`masklab.costs.BlockCosts`).
Loading checks every field and fails with a `MaskFileError` (`CostsFileError` for costs) that
names the file and the field; it never lets a json/numpy traceback escape. Saving is atomic, so an
interrupted save never leaves a half-written file behind.

`atomic_write` (with `atomic_write_bytes` / `atomic_write_text`) is the project's one writer of
whole files: masks and plots here, and the runtime's summaries, reports and exported models. It
lives in masklab because every package may import masklab.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from masklab.costs import BlockCosts
from masklab.errors import CostsFileError, DesignError, MaskError, MaskFileError
from masklab.mask import Mask, Schedule

FORMAT = "sdp-mask"
COSTS_FORMAT = "sdp-costs"
VERSION = 1
_REQUIRED = ("format", "version", "workers", "blocks", "rows")
_OPTIONAL = ("block_names", "block_sizes", "schedule", "construction")


def mask_to_dict(mask: Mask) -> dict[str, Any]:
    """The JSON-ready dictionary of `mask` (format version 1)."""
    schedule: dict[str, Any] = {"kind": mask.schedule.kind, "every": mask.schedule.every}
    if mask.rounds is not None:  # a sequence: its masks in turn, each as 'rows' (round 0 repeats 'rows')
        schedule["rounds"] = [_row_strings(m) for m in mask.rounds]
    return {
        "format": FORMAT,
        "version": VERSION,
        "workers": mask.workers,
        "blocks": mask.blocks,
        "rows": _row_strings(mask.matrix),
        "block_names": list(mask.block_names),
        "block_sizes": None if mask.block_sizes is None else list(mask.block_sizes),
        "schedule": schedule,
        "construction": mask.construction,
    }


def _row_strings(matrix: np.ndarray) -> list[str]:
    return ["".join("1" if x else "0" for x in row) for row in matrix.tolist()]


def mask_from_dict(data: Any, *, source: str = "<dict>") -> Mask:
    """Rebuild a `Mask` from `mask_to_dict` output, checking every field.

    >>> mask_from_dict(mask_to_dict(Mask([[1, 0], [1, 1]]))) == Mask([[1, 0], [1, 1]])
    True
    """
    def fail(msg: str) -> MaskFileError:
        return MaskFileError(f"{source}: {msg}")

    _check_header(data, FORMAT, "mask", fail)
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise fail(f"missing field(s) {missing}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise fail(f"unknown field(s) {unknown}; known fields: {list(_REQUIRED + _OPTIONAL)}")
    workers, blocks = _int_field(data, "workers", fail), _int_field(data, "blocks", fail)
    matrix = _rows_matrix(data["rows"], workers, blocks, fail)
    schedule = _schedule(data.get("schedule"), fail)
    rounds = None
    if schedule.kind == "sequence":
        listed = data["schedule"].get("rounds")
        if not isinstance(listed, list) or not listed:
            raise fail("field 'schedule': kind 'sequence' needs 'rounds', a non-empty list of masks (each a "
                       f"list of row strings like 'rows'), got {listed!r}")
        rounds = [_rows_matrix(r, workers, blocks, lambda msg, i=i: fail(f"schedule round {i}: {msg}"))
                  for i, r in enumerate(listed)]
    construction = data.get("construction")
    if construction is not None and not isinstance(construction, str):
        raise fail(f"field 'construction' must be a string or null, got {construction!r}")
    names, sizes = data.get("block_names"), data.get("block_sizes")
    for field, value in (("block_names", names), ("block_sizes", sizes)):
        if value is not None and not isinstance(value, list):
            raise fail(f"field {field!r} must be a list or null, got {type(value).__name__}")
    try:
        return Mask(matrix, block_names=names, block_sizes=sizes, schedule=schedule,
                    construction=construction, rounds=rounds)
    except MaskError as exc:
        raise fail(str(exc)) from None


def save_mask(mask: Mask, path: str | os.PathLike[str]) -> Path:
    """Write `mask` to `path` atomically; returns the path."""
    if not isinstance(mask, Mask):
        raise TypeError(f"save_mask expects a masklab.Mask, got {type(mask).__name__}")
    path = check_destination(path)
    return atomic_write_text(path, json.dumps(mask_to_dict(mask), indent=1) + "\n")


def atomic_write(path: str | os.PathLike[str], write: Callable[[str], None]) -> Path:
    """Create or replace the file `path` whole: ``write(name)`` fills a fresh file beside it.

    The temporary file (``.NAME.*.tmp`` in the same directory, created exclusively, so never
    through a planted link; mode 0644) is fsynced, renamed over `path` (which replaces a link at
    `path` instead of following it), and the directory is fsynced, so the new content survives a
    crash once this returns. A reader sees the old content or the new, never part of either. If
    `write` raises, the temporary file is removed and `path` keeps its old content (or stays
    absent); the exception propagates.

    Parameters
    ----------
    path : str or PathLike
        The destination; its directory must exist.
    write : callable
        ``write(name)`` writes the content to the file named ``name`` (which exists and is empty),
        e.g. ``lambda name: fig.savefig(name, format="png")``.

    Returns
    -------
    Path
        `path`.

    Examples
    --------
    >>> import tempfile
    >>> from pathlib import Path
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = atomic_write_text(Path(d) / "a.txt", "new")
    ...     try:
    ...         atomic_write(p, lambda name: 1 / 0)
    ...     except ZeroDivisionError:
    ...         pass
    ...     (p.read_text(), sorted(q.name for q in Path(d).iterdir()))
    ('new', ['a.txt'])
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other readers
        finally:
            os.close(fd)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """`atomic_write` of `data`; returns `path`."""
    def write(name: str) -> None:
        with os.fdopen(os.open(name, os.O_WRONLY | os.O_TRUNC | _NOFOLLOW), "wb") as f:
            f.write(data)

    return atomic_write(path, write)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """`atomic_write` of `text` as UTF-8, exactly as given (no newline added); returns `path`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX; skipped where a directory cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself has happened
    finally:
        os.close(fd)


def check_destination(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path if a mask file can be saved there (not a directory, its directory exists).

    Lets a command refuse a bad ``--out`` before it writes anything else.
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise MaskFileError(f"{path}: is a directory; give a file name such as {path / 'mask.json'}")
        if not path.parent.is_dir():
            raise MaskFileError(f"{path}: directory {path.parent} does not exist")
    except OSError as exc:  # name too long, ...
        raise MaskFileError(f"{path}: cannot be written: {exc.strerror or exc}") from None
    return path


def load_mask(path: str | os.PathLike[str]) -> Mask:
    """Read a mask file written by `save_mask`.

    Raises
    ------
    MaskFileError
        The file is missing, a directory, not UTF-8, not complete JSON, of another format, of an
        unknown version, or holds an invalid mask; the message names the file and the problem.
    """
    return mask_from_dict(_read_json(path, "mask", MaskFileError), source=str(path))


def costs_to_dict(costs: BlockCosts) -> dict[str, Any]:
    """The JSON-ready dictionary of `costs` (costs file format version 1)."""
    return {
        "format": COSTS_FORMAT,
        "version": VERSION,
        "block_bytes": list(costs.block_bytes),
        "block_names": None if costs.block_names is None else list(costs.block_names),
        "fixed_bytes": costs.fixed_bytes,
        "source": costs.source,
    }


def costs_from_dict(data: Any, *, source: str = "<dict>") -> BlockCosts:
    """Rebuild `BlockCosts` from `costs_to_dict` output, checking every field.

    >>> costs_from_dict({"format": "sdp-costs", "version": 1, "block_bytes": [4, 8]}).block_bytes
    (4, 8)
    """
    def fail(msg: str) -> CostsFileError:
        return CostsFileError(f"{source}: {msg}")

    _check_header(data, COSTS_FORMAT, "costs", fail)
    known = ("format", "version", "block_bytes", "block_names", "fixed_bytes", "source")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise fail(f"unknown field(s) {unknown}; known fields: {list(known)}")
    if "block_bytes" not in data:
        raise fail("missing field 'block_bytes' (one byte count per block)")
    for field in ("block_bytes", "block_names"):
        if data.get(field) is not None and not isinstance(data[field], list):
            raise fail(f"field {field!r} must be a list, got {type(data[field]).__name__}")
    names = data.get("block_names")
    if names is not None and len(names) != len(data["block_bytes"]):
        raise fail(f"field 'block_names' has {len(names)} entries but 'block_bytes' has {len(data['block_bytes'])}")
    try:
        return BlockCosts(data["block_bytes"], block_names=names, fixed_bytes=data.get("fixed_bytes", 0),
                          source=data.get("source"))
    except DesignError as exc:
        raise fail(str(exc)) from None


def save_costs(costs: BlockCosts, path: str | os.PathLike[str]) -> Path:
    """Write `costs` to `path` atomically; returns the path."""
    if not isinstance(costs, BlockCosts):
        raise TypeError(f"save_costs expects a masklab.costs.BlockCosts, got {type(costs).__name__}")
    path = check_destination(path)
    return atomic_write_text(path, json.dumps(costs_to_dict(costs), indent=1) + "\n")


def load_costs(path: str | os.PathLike[str]) -> BlockCosts:
    """Read a costs file (`save_costs`, or written by hand: docs/design.md §2).

    Raises
    ------
    CostsFileError
        As `load_mask` does for mask files, naming the file and the field.
    """
    return costs_from_dict(_read_json(path, "costs", CostsFileError), source=str(path))


def _read_json(path: str | os.PathLike[str], kind: str, error: type[ValueError]) -> Any:
    """The JSON value in the file `path`, or `error` naming the file and what is wrong with it."""
    path = Path(path)
    try:
        if not path.exists():
            raise error(f"{path}: no such {kind} file")
        if path.is_dir():
            raise error(f"{path}: is a directory, not a {kind} file")
        if not path.is_file():  # a FIFO or device would block or never end
            raise error(f"{path}: not a regular file")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not a text (UTF-8) file: byte {exc.start} cannot be decoded") from None
    except OSError as exc:
        raise error(f"{path}: cannot be read: {exc.strerror}") from None
    if not text.strip():
        raise error(f"{path}: file is empty")
    try:
        return json.loads(text, parse_constant=lambda name: _reject_constant(name, kind))
    except json.JSONDecodeError as exc:
        truncated = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated string")
        hint = " (the file looks truncated)" if truncated else ""
        raise error(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}{hint}") from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity, 4300+ digit integers, deep nesting
        raise error(f"{path}: {exc}") from None


def _reject_constant(name: str, kind: str) -> None:
    raise ValueError(f"non-finite number {name} is not allowed in a {kind} file")


def _int_field(data: dict[str, Any], key: str, fail) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"field {key!r} must be an integer, got {value!r}")
    if value < 1:
        raise fail(f"field {key!r} must be >= 1, got {value}")
    return value


def _rows_matrix(rows: Any, workers: int, blocks: int, fail) -> np.ndarray:
    if not isinstance(rows, list):
        raise fail(f"field 'rows' must be a list of strings of 0/1, got {type(rows).__name__}")
    if len(rows) != workers:
        raise fail(f"field 'rows' has {len(rows)} rows but 'workers' is {workers}")
    for k, row in enumerate(rows):
        if not isinstance(row, str):
            raise fail(f"row {k} must be a string of 0/1, got {type(row).__name__}")
        if len(row) != blocks:
            raise fail(f"row {k} has {len(row)} entries but 'blocks' is {blocks}")
        if set(row) - {"0", "1"}:
            col = next(j for j, ch in enumerate(row) if ch not in "01")
            raise fail(f"row {k}, column {col} is {row[col]!r}; entries must be '0' or '1'")
    buf = np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8) - ord("0")
    return buf.reshape(workers, blocks)


def _schedule(value: Any, fail) -> Schedule:
    if value is None:
        return Schedule()
    if not isinstance(value, dict):
        raise fail(f"field 'schedule' must be an object like {{'kind': 'static', 'every': 1}}, got {value!r}")
    unknown = sorted(set(value) - {"kind", "every", "rounds"})
    if unknown:
        raise fail(f"field 'schedule' has unknown key(s) {unknown}; known: ['every', 'kind', 'rounds']")
    if "rounds" in value and value.get("kind") != "sequence":
        raise fail(f"field 'schedule': 'rounds' belongs to kind 'sequence', not {value.get('kind', 'static')!r}")
    try:
        return Schedule(value.get("kind", "static"), value.get("every", 1))
    except MaskError as exc:
        raise fail(f"field 'schedule': {exc}") from None


def _check_header(data: Any, fmt: str, kind: str, fail: Callable[[str], Exception]) -> None:
    """A JSON object whose ``format`` is `fmt` and whose ``version`` is this masklab's."""
    if not isinstance(data, dict):
        raise fail(f"expected a JSON object at the top level, got {type(data).__name__}")
    if data.get("format") != fmt:
        raise fail(f"not an SDP {kind} file: format is {data.get('format')!r}, expected {fmt!r}")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        raise fail(f"unknown {kind} file version {version!r}; this masklab reads version {VERSION}")
