"""fedgc.files.atomic_write: the one atomic write (temporary file, fsync, os.replace)."""

from __future__ import annotations

import os

import pytest

from fedgc import files


def test_the_new_content_is_synced_before_it_replaces_the_old(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "rounds.csv"
    files.atomic_write_text(path, "old\n")
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def replace(src: str, dst: os.PathLike[str]) -> None:
        calls.append("replace")
        assert open(src).read() == "new\n"
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    assert files.atomic_write_bytes(path, [b"ne", memoryview(b"w\n")]) == path
    assert calls == ["fsync", "replace"]
    assert path.read_text() == "new\n" and os.listdir(path.parent) == ["rounds.csv"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "checkpoint.pt"
    files.atomic_write_bytes(path, b"old")

    def write(fh):
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, write)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["checkpoint.pt"]
