"""nanochat.files.atomic_write, the one write path of reports, plots, tokenizers, GSM8K copies and checkpoint
metas: the new contents appear whole or not at all, and a failed write leaves neither half a file nor a temp file."""

import os

import pytest

from nanochat.files import atomic_write


def test_bytes_text_and_writer_replace_the_file(tmp_path):
    path = tmp_path / "out.md"
    atomic_write(str(path), "ünïcode\n")
    assert path.read_bytes() == "ünïcode\n".encode("utf-8")
    atomic_write(str(path), b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(str(path), lambda f: f.write(b"from a writer"))
    assert path.read_bytes() == b"from a writer"
    assert os.listdir(tmp_path) == ["out.md"]


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "section.md"
    path.write_text("old")

    def half_then_fail(f):
        f.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(str(path), half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["section.md"]


def test_a_relative_path_is_written_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    atomic_write("plot.png", b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"


def test_checkpoint_writes_sweep_temp_files_that_killed_runs_left(tmp_path):
    """A killed save leaves a hidden .<name>.tmp-<pid>; the next write of that checkpoint file removes it
    (one process at a time writes it), update_meta included. Other files' temps and plain atomic writes,
    where another live process may be writing, are left alone."""
    from nanochat.checkpoints.store import save_checkpoint, update_meta
    save_checkpoint(str(tmp_path), 1, {"w": 1}, None, {"step": 1})
    stale = [tmp_path / ".meta_000001.json.tmp-999999", tmp_path / ".model_000001.pt.tmp-999998"]
    other = tmp_path / ".report.md.tmp-999997"
    for path in stale + [other]:
        path.write_bytes(b"half")
    update_meta(str(tmp_path), 1, {"step": 1, "eval": 0.5})
    assert not stale[0].exists() and stale[1].exists() and other.exists()
    save_checkpoint(str(tmp_path), 1, {"w": 2}, None, {"step": 1})
    assert not stale[1].exists() and other.exists()
    atomic_write(str(tmp_path / "report.md"), "text")
    assert other.exists()
