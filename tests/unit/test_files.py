"""scalenlp.files: a file or folder is replaced whole or not at all, and no temporary is left behind."""

from __future__ import annotations

import os

import pytest

from scalenlp import files
from scalenlp.files import replace_folder, replacing_file, write_file


def test_a_failure_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with pytest.raises(OSError, match="disk gone"), replacing_file(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"half of the new")
        raise OSError("disk gone")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_text_and_bytes_replace_the_file(tmp_path):
    target = tmp_path / "state.json"
    write_file(target, "{\"é\": 1}")
    assert target.read_text(encoding="utf-8") == "{\"é\": 1}"
    write_file(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_sync_replaces_nothing(tmp_path, monkeypatch):
    """The data is synced before the rename: a sync that fails leaves the old file, never an unsynced new one."""
    target = tmp_path / "launch.json"
    target.write_text("old")

    def failing_fsync(fd):
        raise OSError("I/O error")

    monkeypatch.setattr(files.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="I/O error"):
        write_file(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["launch.json"]
    write_file(target, "new", durable=False)  # a heartbeat's write does not sync
    assert target.read_text() == "new"


def test_a_private_file_is_0600_and_a_planted_link_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "rank0.json"
    (tmp_path / "rank0.json.tmp").symlink_to(victim)
    os.umask(umask := os.umask(0))  # read the umask: a plain file's mode is what it leaves of 0666
    write_file(target, "{}", private=True)
    assert victim.read_text() == "precious" and target.read_text() == "{}"
    assert target.stat().st_mode & 0o777 == 0o600
    write_file(target, "{}")
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_shared_writers_each_write_their_own_temporary(tmp_path, monkeypatch):
    """Two processes writing one cache file at once: neither removes nor renames the other's half-written file."""
    target = tmp_path / "peak.json"
    monkeypatch.setattr(files.os, "getpid", lambda: 101)
    with replacing_file(target, shared=True) as first:
        first.write_text("first")
        monkeypatch.setattr(files.os, "getpid", lambda: 202)
        with replacing_file(target, shared=True) as second:
            second.write_text("second")
        assert target.read_text() == "second" and first.read_text() == "first"
    assert target.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peak.json"]


def test_a_folder_is_replaced_and_the_old_one_removed(tmp_path):
    out, new = tmp_path / "export", tmp_path / "export.tmp"
    replace_folder(_folder(new, "v1"), out)
    replace_folder(_folder(new, "v2"), out)
    assert (out / "weights").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_crash_between_the_folder_renames_leaves_the_old_one_whole(tmp_path, monkeypatch):
    out, new = tmp_path / "step-4", tmp_path / "step-4.tmp"
    replace_folder(_folder(new, "old"), out)
    real_replace, calls = os.replace, []

    def second_rename_dies(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process is stopped between the renames
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", second_rename_dies)
    with pytest.raises(KeyboardInterrupt):
        replace_folder(_folder(new, "new"), out)
    assert (tmp_path / "step-4.old" / "weights").read_text() == "old"
    assert (new / "weights").read_text() == "new"


def _folder(path, content: str):
    path.mkdir()
    (path / "weights").write_text(content)
    return path
