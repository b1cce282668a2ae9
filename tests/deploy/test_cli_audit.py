"""`olp audit verify` and `olp audit show` on logs an operator may point them at: the live
one, an emptied one, one cut back, copies and lone rotated segments (subprocess, files only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safety.audit import AuditLog

ROOT = Path(__file__).resolve().parents[2]


def olp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _log(path: Path, count: int) -> AuditLog:
    audit = AuditLog(path, fsync=False)
    for index in range(count):
        audit.append("operator", "freeze", {"n": index})
    return audit


def test_an_emptied_log_without_its_head_is_no_proof(tmp_path: Path) -> None:
    """`: > audit.jsonl; rm audit.jsonl.head` gave "audit log OK: 0 records, chain intact"
    and exit 0; the docs promise exit 2, as for no log at all."""
    live = tmp_path / "audit.jsonl"
    _log(live, 5)
    live.write_bytes(b"")
    live.with_name("audit.jsonl.head").unlink()
    for command in ("verify", "show"):
        done = olp("audit", command, str(tmp_path))
        assert done.returncode == 2, done.stdout + done.stderr
        assert "OK" not in done.stdout and "Traceback" not in done.stderr
        assert f"olp: the audit log at {live} holds no records" in done.stderr
        assert "audit.jsonl is empty" in done.stderr and "no audit.jsonl.head" in done.stderr
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "audit.jsonl").touch()
    done = olp("audit", "verify", str(fresh))
    assert done.returncode == 2 and "holds no records" in done.stderr, done.stderr


def test_a_deleted_live_file_whose_head_remains_is_tampering(tmp_path: Path) -> None:
    """The head proves records were written: it is not "no audit log at ..." (exit 2)."""
    live = tmp_path / "audit.jsonl"
    _log(live, 3)
    live.unlink()
    done = olp("audit", "verify", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "audit log TAMPERED at seq 1" in done.stdout


def test_a_log_cut_back_to_its_first_record_says_so(tmp_path: Path) -> None:
    live = tmp_path / "audit.jsonl"
    _log(live, 4)
    live.write_bytes(live.read_bytes().splitlines(keepends=True)[0])
    live.with_name("audit.jsonl.head").unlink()
    done = olp("audit", "verify", str(live))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "audit log OK: 1 records" in done.stdout
    assert "cut back to its first record" in done.stdout


def test_a_live_log_without_its_head_is_still_tampered(tmp_path: Path) -> None:
    live = tmp_path / "audit.jsonl"
    _log(live, 3)
    live.with_name("audit.jsonl.head").unlink()
    done = olp("audit", "verify", str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "TAMPERED at seq" in done.stdout and "audit.jsonl.head is missing" in done.stdout


def _copy(files: list[Path], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for file in files:
        (into / file.name).write_bytes(file.read_bytes())


def _rotated(live: Path) -> list[Path]:
    audit = AuditLog(live, rotate_bytes=1024, fsync=False)
    for index in range(20):
        audit.append("learner", "promotion", {"version": f"policy-v{index}", "pad": "x" * 100})
    segments = sorted(live.parent.glob("audit.jsonl.[0-9]"))
    assert len(segments) >= 2
    return segments


def test_a_backup_without_its_head_is_verified_as_a_copy(tmp_path: Path) -> None:
    """docs/operations.md shows `olp audit verify /backup/audit.jsonl`: a copy made without
    `audit.jsonl.head` was TAMPERED ("head is missing", exit 1) once it held two records,
    and so was a rotated segment archived alone."""
    live = tmp_path / "live" / "audit.jsonl"
    segments = _rotated(live)
    _copy([live], tmp_path / "backup")
    done = olp("audit", "verify", str(tmp_path / "backup" / "audit.jsonl"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "audit log OK as a copy:" in done.stdout and "not proven" in done.stdout
    assert "audit.jsonl.head" in done.stdout

    _copy([segments[0]], tmp_path / "archive-1")
    done = olp("audit", "verify", str(tmp_path / "archive-1" / "audit.jsonl.1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK as a copy" in done.stdout and "(seq 1 to" in done.stdout
    assert str(tmp_path / "archive-1" / "audit.jsonl.1") in done.stdout

    _copy([segments[1]], tmp_path / "archive-2")
    done = olp("audit", "verify", str(tmp_path / "archive-2"))  # a directory of one segment
    assert done.returncode == 2 and "no audit log" in done.stderr, done.stdout + done.stderr
    done = olp("audit", "verify", str(tmp_path / "archive-2" / "audit.jsonl.2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the records before seq" in done.stdout

    # Copied with its head (and the rest of the chain) it is proven to its end.
    _copy([*segments, live, live.with_name("audit.jsonl.head")], tmp_path / "full")
    done = olp("audit", "verify", str(tmp_path / "full"))
    assert done.returncode == 0 and "audit log OK: 20 records" in done.stdout, done.stdout
    assert "copy" not in done.stdout


def test_the_configured_log_is_never_read_as_a_copy(tmp_path: Path) -> None:
    """Without FILE, `verify` checks the state dir's log: with its head and lock deleted it
    is still tampered, not a copy."""
    live = tmp_path / "audit" / "audit.jsonl"
    _log(live, 3)
    live.with_name("audit.jsonl.head").unlink()
    live.with_name("audit.jsonl.lock").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "audit", "verify"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OLP_STATE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "TAMPERED" in done.stdout and "audit.jsonl.head is missing" in done.stdout


def test_a_directory_means_the_log_of_the_configured_name(tmp_path: Path) -> None:
    """With `safety.audit.path: audit/events.jsonl`, `verify <state_dir>/audit` said there
    was no log (it looked for audit.jsonl)."""
    audit_dir = tmp_path / "audit"
    _log(audit_dir / "events.jsonl", 3)
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "audit", "verify", str(audit_dir)],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OLP_STATE_DIR": str(tmp_path),
            "OLP_SAFETY__AUDIT__PATH": "audit/events.jsonl",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"audit log OK: 3 records, chain intact ({audit_dir / 'events.jsonl'})" in done.stdout


def test_a_state_dir_means_the_log_configured_below_it(tmp_path: Path) -> None:
    """`olp audit verify <state_dir>` said there was no audit log (the log is in audit/)."""
    _log(tmp_path / "audit" / "audit.jsonl", 2)
    done = olp("audit", "verify", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"audit log OK: 2 records, chain intact ({tmp_path / 'audit' / 'audit.jsonl'})" in (
        done.stdout
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = olp("audit", "verify", str(empty))
    assert missing.returncode == 2
    assert f"no audit log at {empty / 'audit.jsonl'}" in missing.stderr


def test_an_empty_directory_is_no_log_when_the_configured_path_is_absolute(
    tmp_path: Path,
) -> None:
    """`<dir> / <absolute path>` is the absolute path: an empty backup directory verified as
    the live log ("OK", exit 0)."""
    live = tmp_path / "volume" / "audit.jsonl"
    _log(live, 4)
    backup = tmp_path / "backup"
    backup.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "audit", "verify", str(backup)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OLP_SAFETY__AUDIT__PATH": str(live)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout
    assert f"no audit log at {backup / 'audit.jsonl'}" in done.stderr


def test_show_into_a_reader_that_stops_early_is_not_an_unreadable_log(tmp_path: Path) -> None:
    """`olp audit show | head -1` exited 2 with "cannot read the audit log: Broken pipe";
    the records are printed as they are read, not after the whole log."""
    _log(tmp_path / "audit.jsonl", 3000)
    shown = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "audit", "show", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert shown.stdout is not None and shown.stderr is not None
    first = shown.stdout.readline()
    shown.stdout.close()
    assert shown.wait(120) == 0
    assert "freeze" in first
    assert shown.stderr.read() == ""
