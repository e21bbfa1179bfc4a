"""Token-shard directories (``sdp train --data bin:DIR``): their ``shards.json`` and `write_shards`.

A directory holds raw little-endian token ids in ``*.bin`` files (``val*.bin`` the validation split,
the others training) and a sidecar ``shards.json`` saying how to read them::

    {"format": "sdp-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 256,
     "tokenizer": "bytes", "eot_id": null, "files": {"train_00000.bin": 123456, "val_00000.bin": 1234}}

``dtype`` is ``uint16`` or ``uint32``; ``vocab_size`` the tokenizer's ids (every id below it);
``files`` each shard's token count (``null`` while ``sdp data`` is still writing). A directory
without ``shards.json`` is read as it always was: uint16 ids of an unknown vocabulary.
`write_shards` makes a directory from text files with a byte-level tokenizer or a local Hugging
Face tokenizer directory; nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sdp_train.errors import DataFileError

SIDECAR = "shards.json"
FORMAT = "sdp-token-shards"
DTYPES: dict[str, str] = {"uint16": "<u2", "uint32": "<u4"}  # dtype name -> numpy little-endian code
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per training shard


@dataclass(frozen=True)
class ShardFormat:
    """How a directory's shards are read: `dtype`, and the tokenizer's `vocab_size` where known."""

    dtype: str = "uint16"
    vocab_size: int | None = None
    """Every id is below it; None for a directory without ``shards.json``."""
    tokenizer: str | None = None
    eot_id: int | None = None
    """The id written after every document, if the tokenizer has one."""
    files: dict[str, int] = field(default_factory=dict)
    """Shard file name -> tokens; empty for a directory without ``shards.json``."""


def read_format(directory: str | Path) -> ShardFormat:
    """The format of the shards in `directory`: its ``shards.json``, or uint16 of an unknown vocabulary.

    Raises
    ------
    DataFileError
        ``shards.json`` is unreadable or malformed, or says an ``sdp data`` run did not finish.
    """
    path = Path(directory) / SIDECAR
    if not path.exists():
        return ShardFormat()
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DataFileError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != 1:
        raise DataFileError(f"{path} is not a version-1 {FORMAT!r} description (keys format, version)")
    dtype, vocab, files = meta.get("dtype"), meta.get("vocab_size"), meta.get("files")
    if dtype not in DTYPES:
        raise DataFileError(f"{path}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= np.iinfo(DTYPES[dtype]).max + 1:
        raise DataFileError(f"{path}: vocab_size {vocab!r} must be an integer in 1..{np.iinfo(DTYPES[dtype]).max + 1} "
                            f"for dtype {dtype}")
    if files is None:
        raise DataFileError(f"{path} says its shards are still being written (files: null): an sdp data run "
                            "did not finish; run it again")
    if not isinstance(files, dict) or not all(isinstance(n, str) and isinstance(t, int) and not isinstance(t, bool)
                                              and t >= 0 for n, t in files.items()):
        raise DataFileError(f"{path}: files must map each shard's file name to its token count")
    eot = meta.get("eot_id")
    if eot is not None and (isinstance(eot, bool) or not isinstance(eot, int) or not 0 <= eot < vocab):
        raise DataFileError(f"{path}: eot_id {eot!r} must be null or an id below vocab_size {vocab}")
    return ShardFormat(dtype, vocab, meta.get("tokenizer"), eot, dict(files))


def check_listed(directory: str | Path, fmt: ShardFormat, shards: Sequence[str | Path]) -> None:
    """Refuse shards that ``shards.json`` does not list, or whose size is not its token count."""
    if not fmt.files:
        return
    itemsize = np.dtype(DTYPES[fmt.dtype]).itemsize
    for shard in map(Path, shards):
        if shard.name not in fmt.files:
            raise DataFileError(f"token shard {shard} is not listed in {Path(directory) / SIDECAR}; remove it or "
                                "write the directory again with sdp data")
        want = fmt.files[shard.name] * itemsize
        if shard.stat().st_size != want:
            raise DataFileError(f"token shard {shard} has {shard.stat().st_size} bytes; {SIDECAR} says "
                                f"{fmt.files[shard.name]} {fmt.dtype} tokens ({want} bytes): truncated or replaced")


# -- writing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tokenizer:
    """Text file -> token ids: ``encode(path)`` (a 1-D integer array), its `vocab_size`, `name` and `eot_id`."""

    name: str
    vocab_size: int
    encode: Callable[[Path], np.ndarray]
    eot_id: int | None = None


def byte_tokenizer() -> Tokenizer:
    """One id per byte (256 ids, no end-of-text id): any file, text or not, as it is on disk."""
    return Tokenizer("bytes", 256, lambda path: np.frombuffer(path.read_bytes(), dtype=np.uint8))


def local_tokenizer(directory: str | Path) -> Tokenizer:
    """A Hugging Face tokenizer saved in `directory`: its ``tokenizer.json`` through the ``tokenizers``
    package, else ``transformers.AutoTokenizer`` with ``local_files_only`` (nothing is downloaded).
    The end-of-text id is the tokenizer's eos token, when it has one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataFileError(f"--tokenizer {directory} is neither 'bytes' nor a directory")
    tokenizer_json = directory / "tokenizer.json"
    try:
        if tokenizer_json.is_file() and _importable("tokenizers"):
            return _from_tokenizers(directory, tokenizer_json)
        if _importable("transformers"):
            return _from_transformers(directory)
    except DataFileError:
        raise
    except Exception as exc:  # the libraries' own errors about a malformed directory
        raise DataFileError(f"--tokenizer {directory} cannot be loaded: {type(exc).__name__}: {exc}") from None
    raise DataFileError(f"--tokenizer {directory} needs the tokenizers package (for its tokenizer.json) or "
                        "transformers; neither is usable here (pip install tokenizers)")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _from_tokenizers(directory: Path, tokenizer_json: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tokenizer_json))
    eot = None
    config = directory / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eot = tok.token_to_id(eos) if isinstance(eos, str) else None
    encode = lambda path: np.asarray(tok.encode(_read_text(path), add_special_tokens=False).ids, dtype=np.int64)  # noqa: E731
    return Tokenizer(str(directory), tok.get_vocab_size(with_added_tokens=True), encode, eot)


def _from_transformers(directory: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    encode = lambda path: np.asarray(tok(_read_text(path), add_special_tokens=False)["input_ids"], dtype=np.int64)  # noqa: E731
    return Tokenizer(str(directory), len(tok), encode, tok.eos_token_id)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(f"input {path} is not UTF-8 text (byte {exc.start}): a tokenizer reads text; "
                            "--tokenizer bytes reads any file") from None


def input_files(inputs: Sequence[str | Path], pattern: str = "*.txt") -> list[Path]:
    """The files `inputs` name: files as given, directories' files matching `pattern` (recursively,
    sorted by relative path); refuses a missing input or one that yields no file."""
    files: list[Path] = []
    for item in map(Path, inputs):
        if item.is_file():
            files.append(item)
        elif item.is_dir():
            found = sorted((p for p in item.rglob(pattern) if p.is_file()), key=lambda p: p.relative_to(item).as_posix())
            if not found:
                raise DataFileError(f"input directory {item} holds no file matching {pattern!r} (--glob)")
            files += found
        else:
            raise DataFileError(f"input {item} does not exist")
    if not files:
        raise DataFileError("no input files given")
    return files


@dataclass
class _ShardWriter:
    """Appends token arrays (already of the shard dtype) to ``PREFIX_NNNNN.bin`` files of at most
    `shard_tokens` tokens each, holding at most one shard's tokens in memory."""

    out: Path
    prefix: str
    shard_tokens: int
    files: dict[str, int] = field(default_factory=dict)
    pending: list[np.ndarray] = field(default_factory=list)
    held: int = 0

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            take = min(tokens.size, self.shard_tokens - self.held)
            self.pending.append(tokens[:take])
            self.held += take
            tokens = tokens[take:]
            if self.held == self.shard_tokens:
                self.close()

    def close(self) -> None:
        """Write the tokens held as the next shard, if any."""
        from masklab.io import atomic_write

        if not self.held:
            return
        parts = self.pending

        def write(name: str) -> None:
            with open(name, "wb") as f:
                for part in parts:
                    part.tofile(f)

        name = f"{self.prefix}_{len(self.files):05d}.bin"
        atomic_write(self.out / name, write)
        self.files[name] = self.held
        self.pending, self.held = [], 0


def write_shards(inputs: Sequence[str | Path], out: str | Path, *, tokenizer: Tokenizer, pattern: str = "*.txt",
                 val_every: int = 10, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> ShardFormat:
    """Tokenize the files `inputs` (`input_files`; each one document, in order) into shards and
    ``shards.json`` in `out`.

    Document ``i`` goes to the validation split when ``(i + 1) % val_every == 0`` (the rule of the
    standard-library data); with fewer than `val_every` documents, the last ``1/val_every`` of the
    last document's tokens does. After each document comes the tokenizer's end-of-text id, if it has
    one. `out` must be empty or absent. ``shards.json`` is written first with ``files: null`` and
    completed last, so a directory whose writing was interrupted is refused when read; on an error
    what was written is removed.

    Raises
    ------
    DataFileError
        `out` holds files, an input cannot be read (or decoded), or no token was produced.
    """
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise DataFileError(f"--val-every {val_every!r} must be an integer >= 2")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise DataFileError(f"--shard-tokens {shard_tokens!r} must be a positive integer")
    files = input_files(inputs, pattern)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataFileError(f"--out {out} exists and is not an empty directory; choose a new one")
    if tokenizer.vocab_size > 2**32:
        raise DataFileError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, beyond uint32")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if tokenizer.vocab_size <= 2**16 else "uint32"
    train = _ShardWriter(out, "train", shard_tokens)
    val = _ShardWriter(out, "val", shard_tokens)
    try:
        return _write(files, out, tokenizer, dtype, train, val, val_every)
    except BaseException:
        for name in (SIDECAR, *train.files, *val.files):
            (out / name).unlink(missing_ok=True)
        if created:
            out.rmdir()
        raise


def _write(files: list[Path], out: Path, tokenizer: Tokenizer, dtype: str, train: _ShardWriter, val: _ShardWriter,
           val_every: int) -> ShardFormat:
    from masklab.io import atomic_write_text

    meta = {"format": FORMAT, "version": 1, "dtype": dtype, "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer.name, "eot_id": tokenizer.eot_id, "files": None}
    atomic_write_text(out / SIDECAR, json.dumps(meta, indent=1) + "\n")
    code = DTYPES[dtype]
    eot = np.asarray([] if tokenizer.eot_id is None else [tokenizer.eot_id], dtype=code)
    for i, path in enumerate(files):
        try:
            ids = tokenizer.encode(path)
        except OSError as exc:
            raise DataFileError(f"input {path} cannot be read: {exc.strerror or exc}") from None
        if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise DataFileError(f"input {path}: tokenizer {tokenizer.name} gave id {bad} outside its vocabulary "
                                f"of {tokenizer.vocab_size}")
        tokens = np.concatenate([ids.astype(code), eot])
        if (i + 1) % val_every == 0:
            val.add(tokens)
        elif len(files) < val_every and i == len(files) - 1:
            cut = tokens.size - tokens.size // val_every
            train.add(tokens[:cut])
            val.add(tokens[cut:])
        else:
            train.add(tokens)
    train.close()
    val.close()
    if not train.files or not val.files:
        split = "training" if not train.files else "validation"
        raise DataFileError(f"the inputs ({len(files)} files) gave no {split} tokens; give more text")
    meta["files"] = {**train.files, **val.files}
    atomic_write_text(out / SIDECAR, json.dumps(meta, indent=1) + "\n")
    return ShardFormat(dtype, tokenizer.vocab_size, tokenizer.name, tokenizer.eot_id, meta["files"])


def open_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` -> `byte_tokenizer`, anything else a directory for `local_tokenizer`."""
    return byte_tokenizer() if spec == "bytes" else local_tokenizer(spec)
