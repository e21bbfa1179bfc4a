"""One atomic writer (`masklab.io.atomic_write`) for every file the project writes whole.

A reader sees the old content or the new, never part of either: an exception while writing
leaves the old file as it was and no temporary file beside it; a link planted at the destination
is replaced, never written through; the rename is made durable by an fsync of the directory.
The writers built on it (mask files, mask plots, exported safetensors) are checked the same way,
and no other module renames files into place by hand.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masklab import Mask
from masklab.io import atomic_write, atomic_write_bytes, atomic_write_text, save_mask
from sdp_train.parallel.export import save_safetensors

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Interrupted(Exception):
    pass


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@PROPERTY
@given(old=st.binary(max_size=64), new=st.binary(min_size=1, max_size=256), written=st.integers(0, 256))
def test_an_interrupted_write_leaves_the_old_content_and_no_temporary_file(tmp_path_factory, old, new, written):
    directory = tmp_path_factory.mktemp("atomic")
    path = directory / "out.bin"
    path.write_bytes(old)

    def write_then_fail(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(new[:written])
            f.flush()
        raise Interrupted

    with pytest.raises(Interrupted):
        atomic_write(path, write_then_fail)
    assert path.read_bytes() == old
    assert _names(directory) == ["out.bin"]
    atomic_write_bytes(path, new)
    assert path.read_bytes() == new
    assert _names(directory) == ["out.bin"]


def test_a_new_file_is_not_created_by_a_failed_write(tmp_path):
    with pytest.raises(Interrupted):
        atomic_write(tmp_path / "new.txt", lambda tmp: (_ for _ in ()).throw(Interrupted()))
    assert _names(tmp_path) == []


def test_text_is_utf8_readable_by_others_and_the_rename_is_made_durable(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = atomic_write_text(tmp_path / "a.json", "é\n")
    assert path.read_bytes() == "é\n".encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert synced == ["file", "dir"]


def test_a_link_planted_at_the_destination_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    link = tmp_path / "out.txt"
    link.symlink_to(victim)
    atomic_write_text(link, "new")
    assert not link.is_symlink() and link.read_text() == "new"
    assert victim.read_text() == "keep"


def test_mask_files_are_written_durably(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    save_mask(Mask([[1, 0], [0, 1]]), tmp_path / "m.json")
    assert synced == [False, True]


def test_an_interrupted_safetensors_export_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    import safetensors.torch

    path = tmp_path / "model.safetensors"
    save_safetensors({"w": torch.zeros(2)}, path)
    old = path.read_bytes()

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise Interrupted

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(Interrupted):
        save_safetensors({"w": torch.ones(2)}, path)
    assert path.read_bytes() == old
    assert _names(tmp_path) == ["model.safetensors"]



def test_no_module_renames_files_into_place_but_the_one_writer():
    """A second hand-written temp-and-rename is how the writers drifted to five durabilities."""
    root = Path(__file__).resolve().parents[2]
    renaming = set()
    for package in ("masklab", "theory", "kernels", "sdp_train"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("replace", "rename", "mkstemp")
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in ("os", "tempfile")):
                    renaming.add(str(path.relative_to(root)))
    assert renaming == {"masklab/io.py"}
