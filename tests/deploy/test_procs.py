"""ChildProcess (deploy/procs.py): what it does when the child's log cannot be written, and
how it stops a process group whose leader already died."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from structlog.testing import capture_logs

from deploy.procs import ChildProcess

# 200 lines of 1 kB, more than a pipe holds (64 KiB): the child needs its output read.
_CHATTY = "for i in range(200): print('x' * 1000, flush=True)\nprint('DONE', flush=True)"


def test_a_log_file_that_cannot_be_written_does_not_freeze_the_child(capsys) -> None:
    """Before, the first failed write (disk full) ended the thread reading the child's
    output: nothing drained the pipe, the child blocked on its next write once 64 KiB were
    buffered and stayed alive, and `olp up` never noticed. Now the output is still read
    (its last lines kept for error messages), the file is left alone, and it is said once."""
    with capture_logs() as logs:
        child = ChildProcess("chatty", [sys.executable, "-c", _CHATTY], log_file=Path("/dev/full"))
        try:
            deadline = time.monotonic() + 20
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert child.poll() == 0, "the child is blocked writing its output"
        finally:
            child.stop(timeout_s=2)
    assert child.tail(1) == "DONE"
    said = capsys.readouterr().err
    assert said.count("olp: cannot write chatty's log /dev/full") == 1, said
    assert [e["event"] for e in logs].count("child_log_write_failed") == 1, logs


def test_a_log_file_that_cannot_be_opened_does_not_freeze_the_child(tmp_path: Path) -> None:
    """The same when the log cannot even be opened (here: a directory stands in its way)."""
    log_file = tmp_path / "chatty.log"
    log_file.mkdir()
    child = ChildProcess("chatty", [sys.executable, "-c", _CHATTY], log_file=log_file)
    try:
        deadline = time.monotonic() + 20
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.poll() == 0, "the child is blocked writing its output"
    finally:
        child.stop(timeout_s=2)
    assert child.tail(1) == "DONE"
