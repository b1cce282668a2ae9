"""Audit log: chain integrity, tamper detection, restarts, rotation, concurrent writers."""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from safety.audit import (
    GENESIS_HASH,
    AuditError,
    AuditLog,
    AuditRecordWritten,
    VerifyResult,
    canonical_json,
    format_record,
    head_path,
    iter_records,
    record_hash,
    verify,
)
from safety.config import AuditConfig
from safety.redaction import Redactor


def _write_log(path: Path, count: int) -> AuditLog:
    audit = AuditLog(path)
    for index in range(count):
        audit.append("learner", "gate_result", {"candidate": f"policy-v{index}", "passed": True})
    return audit


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_records_chain_and_hash_canonical_json(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    audit = _write_log(path, 3)
    records = list(audit.iter_records())
    assert [r["seq"] for r in records] == [1, 2, 3]
    assert records[0]["prev_hash"] == GENESIS_HASH
    for previous, record in itertools.pairwise(records):
        assert record["prev_hash"] == previous["hash"]
    body = {k: v for k, v in records[1].items() if k != "hash"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = hashlib.sha256(canonical.encode()).hexdigest()
    assert records[1]["hash"] == expected == record_hash(records[1])
    assert _lines(path)[0] == canonical_json(records[0]) + b"\n"
    result = verify(path)
    assert (result.ok, result.records, result.first_bad_seq) == (True, 3, None)
    assert verify(path.parent).ok  # a directory means its audit.jsonl


def test_edit_any_line_fails_at_its_seq(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    pristine = _lines(path)
    for index in range(5):
        lines = list(pristine)
        record = json.loads(lines[index])
        record["payload"]["passed"] = False
        lines[index] = json.dumps(record).encode() + b"\n"
        path.write_bytes(b"".join(lines))
        result = verify(path)
        assert not result.ok
        assert result.first_bad_seq == index + 1, result.reason
        assert "hash mismatch" in result.reason


def test_rehashed_edit_is_caught_by_the_next_link(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    lines = _lines(path)
    record = json.loads(lines[1])
    record["actor"] = "mallory"
    record["hash"] = record_hash(record)
    lines[1] = canonical_json(record) + b"\n"
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert (result.ok, result.first_bad_seq) == (False, 3)
    assert "prev_hash" in result.reason


@pytest.mark.parametrize("seq", [True, 1.0])
def test_a_seq_that_only_equals_its_number_is_an_edit(tmp_path: Path, seq: object) -> None:
    """`true` and `1.0` equal 1 to Python, and their canonical JSON is the line itself:
    a rehashed record with such a seq passed."""
    path = tmp_path / "audit.jsonl"
    _write_log(path, 1)
    record = json.loads(_lines(path)[0])
    record["seq"] = seq
    record["hash"] = record_hash(record)
    path.write_bytes(canonical_json(record) + b"\n")
    head_path(path).unlink()
    result = verify(path)
    assert (result.ok, result.first_bad_seq) == (False, 1), result.reason
    assert "expected seq 1" in result.reason


def test_delete_any_line_fails_at_its_seq(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    pristine = _lines(path)
    for index in range(5):
        path.write_bytes(b"".join(pristine[:index] + pristine[index + 1 :]))
        result = verify(path)
        assert not result.ok, index
        assert result.first_bad_seq == index + 1, result.reason


def test_insert_a_line_fails_at_that_position(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    pristine = _lines(path)
    forged = dict(json.loads(pristine[1]))
    forged["payload"] = {"candidate": "policy-v99", "passed": True}
    forged["hash"] = record_hash(forged)
    for index, extra in [(2, canonical_json(forged) + b"\n"), (0, pristine[3]), (4, b"{}\n")]:
        path.write_bytes(b"".join([*pristine[:index], extra, *pristine[index:]]))
        result = verify(path)
        assert not result.ok
        assert result.first_bad_seq == index + 1, result.reason


def test_swap_two_lines_fails_at_the_first(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    pristine = _lines(path)
    for first, second in [(0, 1), (1, 3), (3, 4)]:
        lines = list(pristine)
        lines[first], lines[second] = lines[second], lines[first]
        path.write_bytes(b"".join(lines))
        result = verify(path)
        assert (result.ok, result.first_bad_seq) == (False, first + 1), result.reason


def test_restart_continues_the_chain_and_refuses_a_damaged_tail(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    reopened = AuditLog(path)  # a new process or a restart
    record = reopened.append("operator", "freeze", {"learning": True})
    assert (record["seq"], record["prev_hash"]) == (3, list(iter_records(path))[1]["hash"])
    assert verify(path).ok
    with path.open("ab") as handle:
        handle.write(b'{"seq": 4, "broken"}\n')
    with pytest.raises(AuditError, match="not a valid audit record"):
        AuditLog(path).append("operator", "unfreeze")
    assert verify(path).first_bad_seq == 4


def test_an_append_killed_mid_write_leaves_a_tail_the_next_append_removes(
    tmp_path: Path,
) -> None:
    """A kill inside a write of more than a page leaves part of a line, and no head for it.
    That made the log read as tampered and refuse every append (admin changes and
    promotions with it) until someone cut the line off by hand."""
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    torn = b'{"actor":"olp-learner","event":"gate_result","payload":{"results":[{"na'
    with path.open("ab") as handle:
        handle.write(torn)
    checked = verify(path)
    assert checked.ok and checked.interrupted and checked.records == 2
    assert "incomplete last line" in checked.reason
    assert [r["seq"] for r in iter_records(path)] == [1, 2]  # not a record
    with capture_logs() as logs:
        record = AuditLog(path).append("operator", "freeze")
    assert record["seq"] == 4
    removed = list(iter_records(path))[2]
    assert (removed["actor"], removed["event"]) == ("olp-audit-log", "torn_tail_removed")
    assert removed["payload"] == {
        "file": "audit.jsonl",
        "bytes": len(torn),
        "sha256": hashlib.sha256(torn).hexdigest(),
    }
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["audit_torn_tail_removed"]
    checked = verify(path)
    assert checked.ok and not checked.interrupted and checked.records == 4


def test_a_partial_line_the_head_does_not_lead_to_is_refused(tmp_path: Path) -> None:
    """Only a line after the head's own record is an interrupted append: the head is
    written after its line, so a partial line after a record the head does not name
    is not one (and neither is one after records that were deleted)."""
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    lines = _lines(path)
    path.write_bytes(b"".join(lines[:2]) + lines[2][:40])  # seq 3 cut: the head names it
    with pytest.raises(AuditError, match="records were deleted"):
        AuditLog(path).append("operator", "freeze")
    checked = verify(path)
    assert not checked.ok and "incomplete last line" in checked.reason
    assert path.read_bytes() == b"".join(lines[:2]) + lines[2][:40]  # nothing removed


def test_a_first_append_killed_mid_write_is_removed_too(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.with_name("audit.jsonl.lock").touch()  # an append takes the lock before it writes
    path.write_bytes(b'{"actor":"olp-proxy","ev')
    assert verify(path).interrupted
    assert AuditLog(path).append("operator", "freeze")["seq"] == 2
    assert [r["event"] for r in iter_records(path)] == ["torn_tail_removed", "freeze"]
    assert verify(path).ok


def test_appends_killed_at_any_point_of_a_large_write_leave_a_log_that_goes_on(
    tmp_path: Path,
) -> None:
    """Real kills: a process appending a 16 MiB record is killed while it writes (the
    write stops between pages). Whatever it left, the next append goes through and the
    log verifies."""
    path = tmp_path / "audit.jsonl"
    AuditLog(path, redactor=Redactor(enabled=False)).append("operator", "start")
    code = textwrap.dedent(
        f"""
        import sys
        from safety.audit import AuditLog
        from safety.redaction import Redactor
        log = AuditLog({str(path)!r}, redactor=Redactor(enabled=False), rotate_bytes=1 << 40)
        payload = {{"details": "x" * (16 << 20)}}
        print("ready", flush=True)
        sys.stdin.readline()
        log.append("olp-learner", "gate_result", payload)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(4):
        size = path.stat().st_size
        child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == b"ready\n"
        child.stdin.write(b"go\n")
        child.stdin.flush()
        while path.stat().st_size == size and child.poll() is None:
            pass  # the write has begun once the file grows
        child.kill()
        child.wait()
        AuditLog(path, redactor=Redactor(enabled=False)).append("operator", "after-kill")
        assert verify(path).ok


def test_an_append_after_deleting_the_newest_records_is_refused(tmp_path: Path) -> None:
    # Without the head check the next append would chain onto the shortened log and write a
    # new head, and the deletion would verify.
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    pristine = _lines(path)
    path.write_bytes(b"".join(pristine[:2]))
    with pytest.raises(AuditError, match="records were deleted"):
        AuditLog(path).append("operator", "freeze")
    assert _lines(path) == pristine[:2]  # nothing written
    assert not verify(path).ok
    path.unlink()  # the whole live file
    with pytest.raises(AuditError, match="ends at no records"):
        AuditLog(path).append("operator", "freeze")
    assert not path.exists() or path.read_bytes() == b""
    head = path.with_name("audit.jsonl.head")
    path.write_bytes(b"".join(pristine))
    head.unlink()
    with pytest.raises(AuditError, match="missing"):
        AuditLog(path).append("operator", "freeze")
    # Moving every file aside starts a new chain.
    path.unlink()
    assert AuditLog(path).append("operator", "freeze")["seq"] == 1
    assert verify(path).ok


def test_an_interrupted_append_one_record_ahead_of_the_head_is_extended(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 2)
    head = path.with_name("audit.jsonl.head")
    behind = head.read_bytes()
    audit.append("operator", "freeze")
    head.write_bytes(behind)  # a crash between the line and the head
    assert audit.append("operator", "unfreeze")["seq"] == 5
    assert verify(path).ok
    *_, adopted, caught_up, unfreeze = iter_records(path)
    assert (adopted["seq"], adopted["event"]) == (3, "freeze")
    assert (caught_up["actor"], caught_up["event"]) == ("olp-audit-log", "head_caught_up")
    assert caught_up["payload"] == {"seq": 3, "hash": adopted["hash"], "event": "freeze"}
    assert unfreeze["event"] == "unfreeze"


def test_a_record_appended_past_the_head_is_not_adopted_without_a_trace(tmp_path: Path) -> None:
    """Anyone able to write the file can append a record hashed right, without the head:
    `verify` only notes "one record behind", and the next append adopted it in silence,
    after which nothing told it from an operator's."""
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 2)
    [*_, last] = iter_records(path)
    forged = {
        "seq": 3,
        "ts": last["ts"],
        "actor": "alice",
        "event": "rollback",
        "payload": {"to": "policy-v1"},
        "prev_hash": last["hash"],
    }
    forged["hash"] = record_hash(forged)
    with path.open("ab") as out:
        out.write(canonical_json(forged) + b"\n")
    assert verify(path).ok  # one behind: an interrupted append reads the same
    with capture_logs() as logs:
        audit.append("operator", "freeze")
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["audit_head_caught_up"]
    records = list(iter_records(path))
    assert [r["event"] for r in records[2:]] == ["rollback", "head_caught_up", "freeze"]
    assert records[3]["payload"] == {"seq": 3, "hash": forged["hash"], "event": "rollback"}
    assert verify(path).ok


def test_a_catch_up_whose_record_cannot_be_written_leaves_the_head_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Moved up first, the head matched the adopted record when the `head_caught_up` line
    then failed (a full disk): nothing in the log said a record had been adopted."""
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 2)
    head = path.with_name("audit.jsonl.head")
    behind = head.read_bytes()
    audit.append("operator", "freeze")
    head.write_bytes(behind)

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(audit, "_write_line", full_disk)
    with pytest.raises(OSError, match="No space"):
        audit.append("operator", "unfreeze")
    assert head.read_bytes() == behind
    assert "one record behind" in verify(path).reason
    monkeypatch.undo()
    audit.append("operator", "unfreeze")
    assert [r["event"] for r in iter_records(path)][2:] == ["freeze", "head_caught_up", "unfreeze"]


def test_a_crash_between_the_first_line_and_its_head_is_not_tampering(tmp_path: Path) -> None:
    # The first append writes seq 1, then the head; a crash in between leaves no head yet
    # (the "one record behind" case of a new log), which must neither brick the log nor
    # be reported as tampering.
    path = tmp_path / "audit.jsonl"
    _write_log(path, 1)
    head = path.with_name("audit.jsonl.head")
    head.unlink()
    result = verify(path)
    assert (result.ok, result.records) == (True, 1), result.reason
    assert "interrupted" in result.reason
    assert AuditLog(path).append("operator", "freeze")["seq"] == 3  # head_caught_up is 2
    assert verify(path).ok and head.exists()


def test_an_append_whose_head_cannot_be_written_says_its_record_is_in_the_log(
    tmp_path: Path,
) -> None:
    # The line is written and fsynced before the head file; when the head then fails (a full
    # disk), the caller must know the record is in the chain: the proxy undid the change it
    # recorded, and the log kept a record of a change that never served.
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 1)
    blocked = path.with_name("audit.jsonl.head.tmp")
    blocked.mkdir()  # the head's tmp file cannot be written
    with pytest.raises(AuditRecordWritten) as written:
        audit.append("operator", "alias_set", {"target": "policy-v2"})
    assert isinstance(written.value, AuditError)
    assert written.value.record["seq"] == 2 and written.value.record["event"] == "alias_set"
    assert [r["seq"] for r in iter_records(path)] == [1, 2]
    assert verify(path).ok
    # While the head still cannot be written, the next append brings the head up to date
    # before writing its line, and fails there: its record is not in the log. (Before, it
    # wrote seq 3 too, and a chain two records ahead of its head failed verify.)
    with pytest.raises(OSError) as refused:
        audit.append("operator", "freeze")
    assert not isinstance(refused.value, AuditRecordWritten)
    assert [r["seq"] for r in iter_records(path)] == [1, 2]
    assert verify(path).ok
    blocked.rmdir()  # the disk recovers
    assert audit.append("operator", "freeze")["seq"] == 4  # after head_caught_up (seq 3)
    assert [r["event"] for r in iter_records(path)][1:] == [
        "alias_set",
        "head_caught_up",
        "freeze",
    ]
    result = verify(path)
    assert (result.ok, result.records, result.reason) == (True, 4, "")


def test_an_append_whose_line_cannot_be_synced_takes_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fsync of the line fails (EIO): the line was in the file and verified, while the
    # caller, told the append failed, undid the change it recorded. Now the line is cut
    # back off, so a failed append has no record in the log.
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 1)
    size = path.stat().st_size
    fsync = os.fsync
    calls = []

    def fail_first(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fail_first)
    with pytest.raises(OSError) as failed:
        audit.append("operator", "alias_set", {"target": "policy-v2"})
    assert not isinstance(failed.value, AuditRecordWritten)
    monkeypatch.undo()
    assert path.stat().st_size == size
    assert [r["seq"] for r in iter_records(path)] == [1]
    assert audit.append("operator", "freeze")["seq"] == 2
    assert verify(path).ok


def test_a_rotation_that_fails_keeps_the_record_it_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rotation runs after the record and its head are written: its failure is logged and
    # the live file grows on, as when a rotation is blocked; the append succeeded.
    live = tmp_path / "audit.jsonl"
    audit = AuditLog(live, rotate_bytes=1)
    replace = os.replace

    def refuse_segments(src: object, dst: object) -> None:
        if str(dst).endswith(".1"):
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_segments)
    with capture_logs() as logs:
        assert audit.append("operator", "freeze")["seq"] == 1
        assert audit.append("operator", "unfreeze")["seq"] == 2
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["audit_rotation_failed"] * 2
    monkeypatch.undo()
    result = verify(live)
    assert (result.ok, result.records, result.files) == (True, 2, [str(live)])


def test_a_line_that_is_not_canonical_fails(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    lines = _lines(path)
    record = json.loads(lines[0])
    # The same record with a duplicated key whose first value a naive reader would show.
    tampered = b'{"actor":"mallory",' + lines[0][1:]
    assert json.loads(tampered) == record
    for line in (tampered, json.dumps(record).encode() + b"\n"):
        path.write_bytes(line + lines[1])
        result = verify(path)
        assert (result.ok, result.first_bad_seq) == (False, 1)
        assert "canonical" in result.reason


def test_rotation_chains_across_files(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path, rotate_bytes=1024)
    for index in range(20):
        audit.append("learner", "promotion", {"version": f"policy-v{index}", "pad": "x" * 100})
    rotated = sorted(p.name for p in tmp_path.glob("audit.jsonl.[0-9]*"))
    assert len(rotated) >= 2
    result = verify(path)
    assert (result.ok, result.records) == (True, 20)
    assert len(result.files) == len(rotated) + 1 and path.exists()
    assert [r["seq"] for r in iter_records(tmp_path)] == list(range(1, 21))
    AuditLog(path, rotate_bytes=1024).append("operator", "rollback", {"to": "policy-v3"})
    assert verify(path).records == 21
    # Deleting a whole rotated file breaks the chain at its first seq.
    first_rotated = tmp_path / "audit.jsonl.1"
    first_seq_of_second = json.loads(_lines(tmp_path / "audit.jsonl.2")[0])["seq"]
    first_rotated.unlink()
    assert verify(path).first_bad_seq == 1
    assert first_seq_of_second > 1


def test_a_log_path_ending_in_digits_is_its_own_live_file(tmp_path: Path) -> None:
    # `audit.2024` used to be read as rotation 2024 of `audit`: `verify` and `iter_records`
    # read the (missing) `audit` and reported an intact chain of 0 records, and a log named
    # `audit` in the same folder took `audit.2024` for one of its own rotated files.
    live = tmp_path / "audit.2024"
    audit = AuditLog(live, rotate_bytes=1024)
    for index in range(12):
        audit.append("learner", "promotion", {"version": f"policy-v{index}", "pad": "x" * 100})
    rotated = sorted(tmp_path.glob("audit.2024.[0-9]*"))
    assert len(rotated) >= 2
    for given in (live, tmp_path / "audit.2024.1"):  # the live file or one of its rotations
        result = verify(given)
        assert (result.ok, result.records) == (True, 12), given
        assert result.files[-1] == str(live) and len(result.files) == len(rotated) + 1
        assert [r["seq"] for r in iter_records(given)] == list(range(1, 13))
    assert (audit.verify().records, len(list(audit.iter_records()))) == (12, 12)

    neighbour = AuditLog(tmp_path / "audit")
    assert neighbour.append("operator", "freeze", {})["seq"] == 1
    neighbour.append("operator", "unfreeze", {})
    result = verify(tmp_path / "audit")
    assert (result.ok, result.records, result.files) == (True, 2, [str(tmp_path / "audit")])
    assert (verify(live).records, verify(tmp_path / "audit.2024.1").records) == (12, 12)


def test_last_line_keeps_its_newline_so_a_torn_line_shows(tmp_path: Path) -> None:
    # Pins what `_last_line`'s docstring says: an append tells a complete last record from
    # a torn one by its newline.
    from safety.audit import _last_line

    path = tmp_path / "lines"
    path.write_bytes(b"")
    assert _last_line(path) is None
    path.write_bytes(b"one\n")
    assert _last_line(path) == b"one\n"
    path.write_bytes(b"one\n" + b"x" * 9000 + b"\n")  # longer than one read block
    assert _last_line(path) == b"x" * 9000 + b"\n"
    path.write_bytes(b"one\ntwo")
    assert _last_line(path) == b"two"


def test_payload_never_holds_secrets_or_pii(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog.from_config(AuditConfig(), tmp_path, Redactor())
    record = audit.append(
        "admin:ops@example.com",
        "tenant_training_enabled",
        {
            "tenant": "acme",
            "api_key": "plain-secret-value",
            "headers": {"Authorization": "Bearer abcdefghijklmnopqrstuvwxyz", "X-Admin-Key": "k"},
            "note": "reach me at ops@example.com or sk-abcdefghijklmnopqrstuvwxyz1234",
            "max_tokens": 16,
            "completion_tokens": 3,
        },
    )
    raw = (tmp_path / "audit" / "audit.jsonl").read_text()
    for secret in ("plain-secret-value", "abcdefghijklmnopqrstuvwxyz", "ops@example.com"):
        assert secret not in raw
    payload = record["payload"]
    assert payload["api_key"] == "[REDACTED:secret]"
    assert payload["headers"] == {
        "Authorization": "[REDACTED:secret]",
        "X-Admin-Key": "[REDACTED:secret]",
    }
    assert payload["max_tokens"] == 16 and payload["completion_tokens"] == 3
    assert "[REDACTED:email]" in payload["note"] and "[REDACTED:openai_key]" in payload["note"]
    # A pseudonym, not the placeholder: two e-mail actors stay two actors in the log.
    pseudonym = "redacted-" + hashlib.sha256(b"admin:ops@example.com").hexdigest()[:32]
    assert record["actor"] == pseudonym
    other = audit.append("admin:dev@example.com", "freeze", {})
    assert other["actor"].startswith("redacted-") and other["actor"] != pseudonym
    assert audit.append("ops-oncall", "freeze", {})["actor"] == "ops-oncall"
    assert path.exists() is False  # from_config writes under <state_dir>/audit/


def test_keys_that_sanitise_alike_keep_both_values(tmp_path: Path) -> None:
    """Two e-mail keys both read `[REDACTED:email]`, and `1` and `"1"` both `"1"`: one
    value replaced the other in silence."""
    audit = AuditLog(tmp_path / "audit.jsonl", redactor=Redactor(), fsync=False)
    record = audit.append(
        "learner",
        "caps",
        {
            "per_user_tokens": {"alice@example.com": 10, "bob@example.com": 990},
            "by_partition": {1: "a", "1": "b"},
        },
    )
    assert record["payload"] == {
        "per_user_tokens": {"[REDACTED:email]": 10, "[REDACTED:email]#2": 990},
        "by_partition": {"1": "a", "1#2": "b"},
    }
    assert "example.com" not in (tmp_path / "audit.jsonl").read_text()


def test_framework_and_cloud_secret_key_names_are_dropped(tmp_path: Path) -> None:
    # Django/Flask `SECRET_KEY`, boto's `aws_secret_access_key`: before, neither matched a
    # secret name, so their values were written in clear.
    audit = AuditLog.from_config(AuditConfig(), tmp_path, Redactor())
    payload = {"SECRET_KEY": "django-x1", "aws_secret_access_key": "wJal-x2", "sort_key": "k3"}
    record = audit.append("admin", "config_shown", payload)
    assert record["payload"] == {
        "SECRET_KEY": "[REDACTED:secret]",
        "aws_secret_access_key": "[REDACTED:secret]",
        "sort_key": "k3",
    }


def test_camel_case_secret_key_names_are_dropped(tmp_path: Path) -> None:
    # JSON from JavaScript clients names secrets in camelCase: the last camelCase part is a
    # part like the last `_` one (before, `dbPassword` and `authToken` were written in clear).
    audit = AuditLog.from_config(AuditConfig(), tmp_path, Redactor())
    payload = {
        "dbPassword": "hunter2-x1",
        "authToken": "opaque-x2",
        "openaiApiKey": "opaque-x3",
        "XApiKey": "opaque-x4",
        "maxTokens": 16,
        "tokenCount": 3,
        "passwordHint": "pet",
    }
    record = audit.append("admin", "config_shown", payload)
    assert record["payload"] == {
        "dbPassword": "[REDACTED:secret]",
        "authToken": "[REDACTED:secret]",
        "openaiApiKey": "[REDACTED:secret]",
        "XApiKey": "[REDACTED:secret]",
        "maxTokens": 16,
        "tokenCount": 3,
        "passwordHint": "pet",
    }


def test_bad_payload_is_rejected_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 1)
    with pytest.raises(ValueError, match="actor and event"):
        audit.append("", "x")
    with pytest.raises(TypeError):
        audit.append("learner", "gate_result", {"when": object()})
    assert verify(path).records == 1


def test_non_finite_numbers_are_recorded_by_name(tmp_path: Path) -> None:
    """A gate report with an infinite KL used to raise on append: the gate_result record
    was lost and the promotion crashed."""
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 1)
    metrics = {"kl": float("inf"), "delta": float("-inf"), "score": float("nan"), "ok": 0.5}
    audit.append("learner", "gate_result", {"metrics": metrics, "series": [float("nan"), 1.0]})
    assert verify(path).ok and verify(path).records == 2
    payload = list(iter_records(path))[-1]["payload"]
    assert payload == {
        "metrics": {"kl": "inf", "delta": "-inf", "score": "nan", "ok": 0.5},
        "series": ["nan", 1.0],
    }


def test_threads_share_one_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path, fsync=False)
    threads = [
        threading.Thread(target=lambda: [audit.append("t", "e", {"i": i}) for i in range(25)])
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert verify(path).records == 100


def test_two_processes_appending_keep_a_valid_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    script = textwrap.dedent(
        f"""
        import sys
        from safety.audit import AuditLog
        log = AuditLog({str(path)!r}, rotate_bytes=4096)
        for i in range(60):
            log.append(sys.argv[1], "gate_result", {{"i": i}})
        """
    )
    root = Path(__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", script, name], cwd=root)
        for name in ("proxy", "learner")
    ]
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    result = verify(path)
    assert (result.ok, result.records) == (True, 120), result.reason
    actors = [r["actor"] for r in iter_records(path)]
    assert actors.count("proxy") == actors.count("learner") == 60


def test_verify_is_not_fooled_by_an_append_while_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `olp audit verify` runs while the proxy and the learner append. An append (or a
    # rotation) between reading the lines and reading the head must not look like deleted
    # records: a failed check is read again under the writers' lock.
    import safety.audit as audit_module

    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    real_iter_lines = audit_module._iter_lines
    appended: list[dict] = []

    def iter_lines_then_append(files: list[Path]):  # type: ignore[no-untyped-def]
        yield from real_iter_lines(files)
        if not appended:  # once, between the first read's lines and its head
            appended.append(AuditLog(path).append("proxy", "late"))

    monkeypatch.setattr(audit_module, "_iter_lines", iter_lines_then_append)
    result = verify(path)
    assert appended and (result.ok, result.records) == (True, 4), result.reason


def test_verify_is_not_fooled_by_a_rotation_while_it_lists_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rotation renames the live file: between listing the chain files and opening them,
    # `audit.jsonl` may be gone for a moment. Before, `olp audit verify` then failed with
    # FileNotFoundError ("cannot read the audit log") on a sound log.
    import safety.audit as audit_module

    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    real_chain_files = audit_module.chain_files
    rotated: list[Path] = []

    def list_then_rotate(live: Path) -> list[Path]:
        files = real_chain_files(live)
        if not rotated:  # once: the writer renames the live file right after the listing
            rotated.append(live.with_name("audit.jsonl.1"))
            os.replace(live, rotated[0])
        return files

    monkeypatch.setattr(audit_module, "chain_files", list_then_rotate)
    result = verify(path)
    assert rotated and (result.ok, result.records) == (True, 3), result.reason


def test_a_sound_log_is_verified_without_waiting_for_writers(tmp_path: Path) -> None:
    # The proxy appends on its event loop: a verify of a sound log must not take the lock
    # (a writer holding it must not delay the check, nor the check the writer).
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    fd = os.open(path.with_name("audit.jsonl.lock"), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done: list[VerifyResult] = []
        checker = threading.Thread(target=lambda: done.append(verify(path)))
        checker.start()
        checker.join(timeout=10)
        assert done and done[0].ok and done[0].records == 3
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def test_iter_records_sees_a_whole_prefix_while_a_writer_rotates(tmp_path: Path) -> None:
    # `olp audit show` reads while the proxy appends and rotates: every read must be the
    # chain's first n records, none missing (a rotation between listing the files and
    # opening the live one) and none twice.
    path = tmp_path / "audit.jsonl"
    script = textwrap.dedent(
        f"""
        from safety.audit import AuditLog
        log = AuditLog({str(path)!r}, rotate_bytes=400, fsync=False)
        for i in range(600):
            log.append("proxy", "request", {{"i": i}})
        """
    )
    root = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", script], cwd=root, stdout=subprocess.DEVNULL)
    reads = bad = 0
    try:
        while writer.poll() is None:
            seqs = [record["seq"] for record in iter_records(path)]
            reads += 1
            bad += seqs != list(range(1, len(seqs) + 1))
    finally:
        assert writer.wait(timeout=120) == 0
    assert reads > 20 and not bad, f"{bad} of {reads} reads were not a prefix"
    assert [record["seq"] for record in iter_records(path)] == list(range(1, 601))


def test_iter_records_does_not_hold_the_lock_while_the_caller_works(tmp_path: Path) -> None:
    # The proxy appends on its event loop: a slow consumer of `iter_records` (a pager) must
    # not keep writers waiting, and it still sees the records as they were when it started.
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path, rotate_bytes=300, fsync=False)
    for index in range(5):
        audit.append("learner", "gate_result", {"i": index})
    records = iter_records(path)
    first = next(records)
    writer = threading.Thread(
        target=lambda: [audit.append("proxy", "late", {"i": i}) for i in range(10)],
        daemon=True,  # were it blocked on the lock, it must not hang the test run
    )
    writer.start()
    writer.join(timeout=10)
    assert not writer.is_alive()
    assert [first["seq"]] + [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["seq"] for r in iter_records(path)] == list(range(1, 16))


def test_format_record_is_one_readable_line(tmp_path: Path) -> None:
    record = _write_log(tmp_path / "audit.jsonl", 1).append(
        "operator", "rollback", {"to": "policy-v2", "reason": "canary worse"}
    )
    line = format_record(record)
    assert line.startswith("#2 ") and "operator rollback" in line
    assert 'to="policy-v2"' in line and "\n" not in line


@pytest.mark.parametrize("line", [b"[1, 2]\n", b'"seq"\n', b"42\n", b"null\n"])
def test_iter_records_names_a_line_that_is_not_a_record(tmp_path: Path, line: bytes) -> None:
    # `olp audit show` on a damaged log must say where it is damaged (AuditError, which the
    # CLI reports) instead of crashing on `.get` of a list or a number.
    path = tmp_path / "audit.jsonl"
    _write_log(path, 2)
    path.write_bytes(_lines(path)[0] + line)
    with pytest.raises(AuditError, match=r"audit\.jsonl:2 is not a JSON object"):
        list(iter_records(path))


def test_format_record_shows_a_payload_that_is_not_an_object(tmp_path: Path) -> None:
    # A hand-edited record: show it as it is rather than crash the whole listing.
    record = {"seq": 7, "ts": "t", "actor": "a", "event": "e", "payload": ["x", 1], "hash": "f"}
    assert format_record(record) == '#7 t a e payload=["x", 1] [f]'
    assert format_record({**record, "payload": None}) == "#7 t a e [f]"


@pytest.mark.parametrize("name", ["audit[1].jsonl", "audit*.jsonl", "audit?.jsonl"])
def test_rotations_of_a_log_whose_name_holds_glob_characters_are_found(
    tmp_path: Path, name: str
) -> None:
    path = tmp_path / name
    audit = AuditLog(path, rotate_bytes=1024)
    for index in range(20):
        audit.append("learner", "promotion", {"version": f"policy-v{index}", "pad": "x" * 100})
    assert len(list(tmp_path.iterdir())) > 4  # the live file, its head and lock, rotations
    result = verify(path)
    assert (result.ok, result.records) == (True, 20)
    assert [r["seq"] for r in iter_records(path)] == list(range(1, 21))


def _rotated_log(path: Path, records: int = 20) -> AuditLog:
    audit = AuditLog(path, rotate_bytes=1024)
    for index in range(records):
        audit.append("learner", "promotion", {"version": f"policy-v{index}", "pad": "x" * 100})
    return audit


@pytest.mark.parametrize("name", ["audit.jsonl", "audit"])
def test_files_named_like_segments_beside_the_log_are_not_part_of_the_chain(
    tmp_path: Path, name: str
) -> None:
    # A dated copy (`audit.jsonl.20240501`, or `audit.2024` beside a log named `audit`), a
    # zero-padded or non-ASCII number, a directory: none is a segment the writer made.
    # They used to be read as rotations: `verify` reported tampering (or crashed: `int()`
    # cannot read `²`), and once the live file was empty after a rotation, appends took the
    # copy's last record for the chain's and refused to write.
    live = tmp_path / name
    audit = _rotated_log(live)
    segments = sorted(tmp_path.glob(f"{name}.[0-9]"))
    assert len(segments) >= 2
    strays = [tmp_path / f"{name}.{suffix}" for suffix in ("2024", "20240501", "01", "²", "١")]
    for stray in strays:
        stray.write_bytes(live.read_bytes() or segments[0].read_bytes())
    (tmp_path / f"{name}.99").mkdir()
    strays.append(tmp_path / f"{name}.99")

    result = verify(live)
    assert (result.ok, result.records, result.first_bad_seq) == (True, 20, None), result.reason
    assert sorted(result.ignored) == sorted(str(stray) for stray in strays)
    assert result.files == [*map(str, segments), str(live)]
    assert [r["seq"] for r in iter_records(live)] == list(range(1, 21))
    # Appends and rotations carry on after the real last segment.
    _write_log_more(audit, 10)
    assert verify(live).records == 30 and verify(live).ok
    assert [r["seq"] for r in iter_records(tmp_path / name)] == list(range(1, 31))
    # Named directly, a copy is read as itself, not as the log it sits beside.
    assert verify(tmp_path / f"{name}.20240501").files == [str(tmp_path / f"{name}.20240501")]
    assert verify(segments[-1]).records == 30  # a real segment still means its log


def _write_log_more(audit: AuditLog, count: int) -> None:
    for index in range(count):
        audit.append("learner", "promotion", {"version": f"more-{index}", "pad": "y" * 100})


def test_a_missing_segment_still_fails_and_names_the_segments_left_out(tmp_path: Path) -> None:
    live = tmp_path / "audit.jsonl"
    _rotated_log(live, 30)
    numbered = [p for p in tmp_path.glob("audit.jsonl.*") if p.suffix[1:].isdigit()]
    segments = sorted(numbered, key=lambda p: int(p.suffix[1:]))
    assert len(segments) >= 4
    first_seq_of_second = json.loads(_lines(segments[1])[0])["seq"]
    segments[1].unlink()
    result = verify(live)
    assert (result.ok, result.first_bad_seq) == (False, first_seq_of_second)
    assert result.ignored == [str(path) for path in segments[2:]]
    assert all(path.name in result.reason for path in segments[2:])


def test_rotation_never_renames_over_a_file_outside_the_chain(tmp_path: Path) -> None:
    # The next segment's name taken by something that is not a segment (here a directory):
    # rotation used to `os.replace` onto it (or, for a dated file, continue numbering after
    # it); now the live file keeps growing and the chain stays whole.
    live = tmp_path / "audit.jsonl"
    audit = AuditLog(live, rotate_bytes=1024)
    (tmp_path / "audit.jsonl.1").mkdir()
    (tmp_path / "audit.jsonl.1" / "keep").write_text("operator's notes")
    _write_log_more(audit, 15)
    assert (tmp_path / "audit.jsonl.1" / "keep").read_text() == "operator's notes"
    result = verify(live)
    assert (result.ok, result.records, result.files) == (True, 15, [str(live)])
    assert result.ignored == [str(tmp_path / "audit.jsonl.1")]
    assert live.stat().st_size > 1024


def test_rotation_never_draws_a_numbered_file_after_a_gap_into_the_chain(tmp_path: Path) -> None:
    # `audit.jsonl.3` of an old chain beside a log with one segment: rotation wrote `.2`,
    # which closed the gap, so `.3` became part of the chain; `verify` failed and every
    # append (its last record was then `.3`'s, not the head's) raised AuditError.
    old = tmp_path / "old" / "audit.jsonl"
    _rotated_log(old, 30)
    live = tmp_path / "audit.jsonl"
    audit = AuditLog(live, rotate_bytes=1024)
    while not (tmp_path / "audit.jsonl.1").exists():
        _write_log_more(audit, 1)
    stray = tmp_path / "audit.jsonl.3"
    stray.write_bytes((old.parent / "audit.jsonl.3").read_bytes())
    records = verify(live).records
    with capture_logs() as logs:
        _write_log_more(audit, 15)
    assert not (tmp_path / "audit.jsonl.2").exists()
    assert live.stat().st_size > 1024  # the live file grows on, as for a taken name
    assert {"event": "audit_rotation_blocked", "target": stray.name} in [
        {key: entry.get(key) for key in ("event", "target")} for entry in logs
    ]
    result = verify(live)
    assert (result.ok, result.records) == (True, records + 15)
    assert result.files == [str(tmp_path / "audit.jsonl.1"), str(live)]
    assert result.ignored == [str(stray)]
    # Once the operator moves it away, rotation goes on where it stopped.
    stray.rename(tmp_path / "old-audit.jsonl.3")
    _write_log_more(audit, 1)
    result = verify(live)
    assert (result.ok, result.records, result.ignored) == (True, records + 16, [])
    assert result.files[:2] == [str(tmp_path / f"audit.jsonl.{n}") for n in (1, 2)]


def test_format_record_shows_a_gate_result_as_one_verdict_per_gate() -> None:
    """The whole results (details of every monitor, repeated per monitor) made one
    `olp audit show` line about 6 KB long."""
    shared = {"candidate": {"mean_tokens": 13.5}, "incumbent": {"mean_tokens": 14.6}}
    results = [
        {
            "name": "regression",
            "metric": 1.0,
            "threshold": 0.775,
            "comparison": ">=",
            "verdict": "pass",
            "details": {"probes": 8},
        },
        {
            "name": "monitor.length_drift",
            "metric": 0.073,
            "threshold": 0.5,
            "comparison": "<=",
            "verdict": "pass",
            "details": shared,
        },
        {
            "name": "poisoning",
            "metric": 0.666667,
            "threshold": 0.5,
            "comparison": "<=",
            "verdict": "fail",
            "details": {"shared_payload_by_probe": {"trig-sudo": 0.6667}},
        },
        {
            "name": "safety_probes",
            "metric": None,
            "threshold": None,
            "comparison": "<=",
            "verdict": "fail",
            "details": {"reason": "ClassifierError: " + "x" * 200},
        },
    ]
    record = {
        "seq": 14,
        "ts": "t",
        "actor": "olp-learner",
        "event": "gate_result",
        "hash": "ab",
        "payload": {"version": "policy-v4", "passed": False, "results": results},
    }
    line = format_record(record)
    assert line == (
        "#14 t olp-learner gate_result passed=false results=[regression 1.0>=0.775 pass, "
        "monitor.length_drift 0.073<=0.5 pass, poisoning 0.666667<=0.5 FAIL, "
        f"safety_probes FAIL (ClassifierError: {'x' * 62}…)] "
        'version="policy-v4" [ab]'
    )
    # Another event's `results`, or results of another shape, are shown whole as before.
    other = {**record, "event": "replay_run"}
    assert '"details": {"probes": 8}' in format_record(other)
    odd = {**record, "payload": {"results": "not a list"}}
    assert format_record(odd).endswith('results="not a list" [ab]')


def test_an_emptied_log_without_its_head_verifies_no_records_and_says_so(tmp_path: Path) -> None:
    # `: > audit.jsonl; rm audit.jsonl.head` left a chain of 0 records with no head to
    # disagree with, and `verify` said only "ok": an empty chain proves nothing.
    path = tmp_path / "audit.jsonl"
    _write_log(path, 5)
    path.write_bytes(b"")
    path.with_name("audit.jsonl.head").unlink()
    for result in (verify(path), AuditLog(path).verify()):
        assert result.records == 0 and result.empty
        assert "no records" in result.reason and "proves nothing" in result.reason
    # With its head still there, the same emptied file is a deletion, as before.
    _write_log(tmp_path / "other" / "audit.jsonl", 3).path.write_bytes(b"")
    result = verify(tmp_path / "other" / "audit.jsonl")
    assert (result.ok, result.first_bad_seq) == (False, 1)


def test_a_log_cut_back_to_its_first_record_is_reported_as_such(tmp_path: Path) -> None:
    # Cutting a log back to seq 1 and deleting its head leaves exactly what a crash between
    # the first line and its head leaves: no file tells the two apart, so the reason names
    # both instead of only the harmless one.
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    path.write_bytes(_lines(path)[0])
    path.with_name("audit.jsonl.head").unlink()
    result = verify(path)
    assert (result.ok, result.records) == (True, 1)
    assert "interrupted" in result.reason and "cut back" in result.reason


def _copy(files: list[Path], into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    copies = []
    for file in files:
        (into / file.name).write_bytes(file.read_bytes())
        copies.append(into / file.name)
    return copies


def test_a_copy_without_its_head_checks_its_own_chain_and_says_its_end_is_unproven(
    tmp_path: Path,
) -> None:
    # `olp audit verify /backup/audit.jsonl` of a copy made without `audit.jsonl.head`
    # reported TAMPERED ("head is missing") once it held two records, and so did a rotated
    # segment copied out alone: neither has a head to prove its end, but its records' own
    # chain can still be checked.
    live = tmp_path / "live" / "audit.jsonl"
    _rotated_log(live, 20)
    segments = sorted(live.parent.glob("audit.jsonl.[0-9]"))
    assert len(segments) >= 2

    (copy,) = _copy([live], tmp_path / "backup")
    result = verify(copy)
    assert (result.ok, result.copy, result.first_seq) == (True, True, _seq(live, 0))
    assert result.records == len(_lines(live)) and "head" in result.reason
    (first,) = _copy([segments[0]], tmp_path / "segment-1")
    result = verify(first)
    assert (result.ok, result.copy, result.first_seq) == (True, True, 1)
    assert result.records == len(_lines(segments[0])) and result.files == [str(first)]
    (second,) = _copy([segments[1]], tmp_path / "segment-2")
    result = verify(second)
    assert (result.ok, result.copy, result.first_seq) == (True, True, _seq(segments[1], 0))
    assert f"before seq {result.first_seq}" in result.reason
    # The whole log copied with its head is proven to its end, as the live one is.
    whole = _copy([*segments, live, live.with_name("audit.jsonl.head")], tmp_path / "full")
    result = verify(whole[-2])
    assert (result.ok, result.copy, result.records) == (True, False, 20)

    # A copy's own chain is checked as strictly as the live one: an edit, a deleted line.
    lines = _lines(second)
    record = json.loads(lines[1])
    record["actor"] = "mallory"
    second.write_bytes(lines[0] + canonical_json(record) + b"\n" + b"".join(lines[2:]))
    assert (verify(second).ok, verify(second).first_bad_seq) == (False, record["seq"])
    (gap,) = _copy([segments[0]], tmp_path / "segment-1-gap")
    gap.write_bytes(b"".join(_lines(gap)[:1] + _lines(gap)[2:]))
    assert (verify(gap).ok, verify(gap).first_bad_seq) == (False, 2)
    # A copy that starts at seq 1 must start the chain.
    lines = _lines(first)
    record = json.loads(lines[0])
    record["prev_hash"] = "1" * 64
    record["hash"] = record_hash(record)
    first.write_bytes(canonical_json(record) + b"\n" + b"".join(lines[1:]))
    assert (verify(first).ok, verify(first).first_bad_seq) == (False, 1)

    # In the live directory a segment after a gap is read as a copy when named alone, and
    # the reason sends the reader to the log, whose own check still fails.
    segments[0].unlink()
    result = verify(segments[1])
    assert (result.ok, result.copy) == (True, True)
    assert "lies beside the live log audit.jsonl" in result.reason
    assert (verify(live).ok, verify(live.parent).ok) == (False, False)


def _seq(path: Path, index: int) -> int:
    return json.loads(_lines(path)[index])["seq"]


def test_the_live_log_still_needs_its_head(tmp_path: Path) -> None:
    # A file with its lock beside it is a log a writer appends to: without the head its end
    # is unproven, which is tampering there, not a copy. The writer's own `verify` and a
    # caller that names the live log (`require_head`) never read it as a copy at all.
    path = tmp_path / "audit.jsonl"
    audit = _write_log(path, 3)
    path.with_name("audit.jsonl.head").unlink()
    assert (verify(path).ok, verify(path).copy) == (False, False)
    assert "missing" in verify(path).reason
    path.with_name("audit.jsonl.lock").unlink()
    assert (audit.verify().ok, verify(path, require_head=True).ok) == (False, False)


def test_verify_beside_a_busy_writer_reports_no_interrupted_append(tmp_path: Path) -> None:
    """Read unlocked, an append between its line and its head looks like one a crash
    stopped: `olp audit verify` beside a working proxy printed "interrupted append" in
    over half of its checks. Such a result is read again under the lock."""
    path = tmp_path / "audit.jsonl"
    AuditLog(path, fsync=False).append("operator", "start")
    code = textwrap.dedent(
        f"""
        from safety.audit import AuditLog
        log = AuditLog({str(path)!r}, fsync=False)
        for i in range(2000):
            log.append("olp-proxy", "alias_set", {{"i": i}})
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    writer = subprocess.Popen([sys.executable, "-c", code], env=env)
    results = []
    while writer.poll() is None:
        results.append(verify(path))
    assert writer.wait() == 0
    assert results and all(r.ok for r in results)
    assert [r.reason for r in results if r.interrupted] == []
