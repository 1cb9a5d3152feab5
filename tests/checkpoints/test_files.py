"""nanochat.files.atomic_write, the one write path of reports, plots, tokenizers, GSM8K copies and checkpoint
metas: the new contents appear whole or not at all, and a failed write leaves neither half a file nor a temp file."""

import os

import pytest

from nanochat.files import (NotWritableError, WriteFailedError, atomic_write, check_writable_dir, check_writable_file,
                           write_errors)


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


def test_a_folder_that_cannot_be_written_is_said_before_and_the_check_leaves_nothing(tmp_path):
    """check_writable_dir: a folder under a regular file (refused for root too, unlike a chmod) is one line naming the
    path, the file in the way and the fix; a writable folder it had to make is gone again afterwards (a refused run
    leaves no empty run folder for --resume to pick)."""
    blocker = tmp_path / "report"
    blocker.write_text("a file where a folder should be")
    with pytest.raises(NotWritableError) as e:
        check_writable_dir(str(blocker / "run"), "the run's report", "set NANOCHAT_BASE_DIR")
    assert str(e.value) == (f"cannot write the run's report to {blocker / 'run'}: Not a directory ({blocker} is a "
                            f"file); set NANOCHAT_BASE_DIR")
    with pytest.raises(NotWritableError, match="report: it is a file, not a folder; y"):
        check_writable_dir(str(blocker), "x", "y")
    with pytest.raises(NotWritableError, match="it is a directory; pass --output"):
        check_writable_file(str(tmp_path), "the results", "pass --output")
    assert check_writable_dir(str(tmp_path / "a" / "b"), "x", "y") == str(tmp_path / "a" / "b")
    assert sorted(os.listdir(tmp_path)) == ["report"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through any permission")
def test_a_read_only_folder_is_said_before(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    try:
        with pytest.raises(NotWritableError, match=f"cannot write x to {folder}: Permission denied; y"):
            check_writable_dir(str(folder), "x", "y")
    finally:
        folder.chmod(0o700)


def test_a_write_that_fails_later_is_one_line_with_what_was_kept(tmp_path):
    with pytest.raises(WriteFailedError) as e:
        with write_errors(lambda: "step 3 was kept"):
            open(tmp_path / "missing" / "out.json", "w")
    assert str(e.value) == (f"could not write {tmp_path / 'missing' / 'out.json'}: No such file or directory; step 3 "
                            f"was kept; check the disk, or write elsewhere")


@pytest.mark.parametrize("error", [ConnectionError("peer closed"), TimeoutError("collective timed out"),
                                   OSError(5, "Input/output error")])
def test_an_error_that_is_no_files_write_passes_through_as_it_is(error):
    """A failed write becomes "could not write <file>": an OSError of no file (a socket, a collective's timeout, an
    error naming no path) inside the training loop's guard is not one, and keeps its own type and message."""
    with pytest.raises(type(error)) as e:
        with write_errors(lambda: "step 3 was kept"):
            raise error
    assert e.value is error
