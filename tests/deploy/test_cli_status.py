"""`olp status` and the operator commands against a running proxy (in-process, no upstream
needed: the status and freeze routes do not call one)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli_ops import format_history_entry, format_status
from deploy.ports import free_port
from proxy.app import build_app
from proxy.config import ProxyConfig
from tests.proxy.conftest import ADMIN_KEY, CollectingSink, ProxyHarness, default_tenants

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def running_proxy(tmp_path: Path) -> Iterator[ProxyHarness]:
    config = ProxyConfig(upstreams=[f"http://127.0.0.1:{free_port()}"], port=0, admin_key=ADMIN_KEY)
    app = build_app(config, default_tenants(), CollectingSink(), tmp_path / "state")
    harness = ProxyHarness(app).start()
    yield harness
    harness.stop()


def olp(harness: ProxyHarness, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OLP_PROXY__PORT": str(harness.port),
            "OLP_ADMIN_KEY": ADMIN_KEY,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_plain_freeze_keeps_learning_paused_by_an_earlier_one(
    running_proxy: ProxyHarness,
) -> None:
    """One operator paused learning (`olp freeze --learning`); another's `olp freeze`, to
    make sure promotions were stopped, resumed it on the traffic under investigation and
    printed only `frozen: promotions stopped`."""
    assert olp(running_proxy, "freeze", "--learning").returncode == 0
    again = olp(running_proxy, "freeze")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[0] == "frozen: promotions stopped and learning paused"
    assert running_proxy.ctx.state.learning_frozen is True
    assert olp(running_proxy, "unfreeze").returncode == 0
    plain = olp(running_proxy, "freeze")
    assert plain.stdout.splitlines()[0] == "frozen: promotions stopped"
    assert running_proxy.ctx.state.learning_frozen is False
    # --json prints the proxy's answer alone (the human line before it broke `| jq`).
    answer = json.loads(olp(running_proxy, "freeze", "--json").stdout)
    assert answer["frozen"] is True and answer["learning_frozen"] is False


class ForwardProxy:
    """A listening socket standing for a corporate forward proxy: notes every connection."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.seen: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                with conn:
                    conn.settimeout(2)
                    with contextlib.suppress(OSError):
                        self.seen.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")


def test_operator_commands_and_the_learner_never_send_the_admin_key_through_http_proxy(
    running_proxy: ProxyHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """urllib (the CLI) and httpx (the learner) follow $http_proxy even for 127.0.0.1: with
    a shell exporting a corporate proxy, `olp status` sent `Authorization: Bearer <admin
    key>` to it in clear text, and the operator saw its 502."""
    from learner.promotion import ProxyAdmin

    forward = ForwardProxy()
    proxies = {"http_proxy": forward.url, "HTTP_PROXY": forward.url, "no_proxy": "", "NO_PROXY": ""}
    done = olp(running_proxy, "status", **proxies)
    assert done.returncode == 0, done.stderr
    for name, value in proxies.items():
        monkeypatch.setenv(name, value)
    assert ProxyAdmin(running_proxy.base_url, ADMIN_KEY).status()["frozen"] is False
    assert forward.seen == []
    forward.server.close()


def test_status_shows_what_the_proxy_reports(running_proxy: ProxyHarness, tmp_path: Path) -> None:
    done = olp(running_proxy, "freeze", "--learning")
    assert done.returncode == 0, done.stderr
    gates = tmp_path / "state" / "gates"  # what the learner writes beside the proxy's state
    gates.mkdir(parents=True)
    poisoning = {"name": "poisoning", "metric": 0.666667, "comparison": "<=", "threshold": 0.5}
    report = {"passed": False, "started_at": 0, "duration_s": 102.71, "results": [poisoning]}
    (gates / "policy-v4.json").write_text(json.dumps(report))
    done = olp(running_proxy, "status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "serving: base   frozen: True   learning frozen: True"
    assert "aliases: policy -> base, base -> base" in lines
    assert "tenant alice: training on" in lines and "tenant bob: training off" in lines
    assert any(line.startswith("upstreams: http://127.0.0.1:") for line in lines)
    gates_at = lines.index("gates (newest last):")
    history = lines[lines.index("history (newest last):") + 1 : gates_at]
    # Readable like `olp audit show`: time, actor, change (it was the raw JSON entry).
    assert re.fullmatch(r"  \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \S+ freeze learning=true", history[-1])
    # A rejection is no alias change: `history` never showed it.
    assert lines[gates_at + 1 :] == [
        "  policy-v4 rejected  1970-01-01T00:00:00Z  102.7 s  poisoning (0.667 > 0.5)"
    ]


def test_status_shows_what_the_gate_decided_lately() -> None:
    assert "gates" not in format_status({"serving_version": "base", "gates": []})
    gates = [
        {
            "version": "policy-v3",
            "passed": True,
            "started_at": 1_796_121_021.0,
            "duration_s": 86.31,
            "failed": [],
            "error": None,
        },
        {
            "version": "policy-v4",
            "passed": False,
            "started_at": 1_796_121_221.0,
            "duration_s": 102.7,
            "failed": [
                {"name": "poisoning", "metric": 0.666667, "comparison": "<=", "threshold": 0.5},
                # Rounded alike to 3 digits: shown with as many as tell them apart.
                {"name": "kl_to_base", "metric": 0.0501, "comparison": "<=", "threshold": 0.05},
                {"name": "win_rate", "metric": 0.4, "comparison": ">=", "threshold": 0.55},
            ],
            "error": None,
        },
        {
            "version": "policy-v5",
            "passed": False,
            "started_at": None,
            "duration_s": 4.04,
            "failed": [
                {"name": "safety_probes", "metric": None, "reason": "GateError: upstream 502"},
                {"name": "suite", "metric": None, "reason": None},
            ],
            "error": None,
        },
        {"version": "policy-v6", "passed": None, "error": "Expecting value: line 1 column 1"},
    ]
    lines = format_status({"serving_version": "policy-v3", "gates": gates}).splitlines()
    assert lines[lines.index("gates (newest last):") + 1 :] == [
        "  policy-v3 passed    2026-12-01T10:30:21Z   86.3 s",
        "  policy-v4 rejected  2026-12-01T10:33:41Z  102.7 s  poisoning (0.667 > 0.5), "
        "kl_to_base (0.0501 > 0.05), win_rate (0.4 < 0.55)",
        "  policy-v5 rejected  ?    4.0 s  safety_probes (no metric: GateError: upstream 502), "
        "suite (no metric)",
        "  policy-v6 unreadable: Expecting value: line 1 column 1",
    ]


def test_history_entry_format_survives_odd_entries() -> None:
    assert format_history_entry({"kind": "rollback", "at": "x"}) == "x ? rollback"
    assert (
        format_history_entry(
            {"kind": "alias", "at": 0, "actor": "a", "alias": "policy", "target": "policy-v2"}
        )
        == '1970-01-01T00:00:00Z a alias alias="policy" target="policy-v2"'
    )


def _actors(harness: ProxyHarness) -> list[str]:
    return [record["actor"] for record in harness.ctx.audit.iter_records()]


def test_cli_changes_are_audited_under_who_made_them(running_proxy: ProxyHarness) -> None:
    """Every change made with the `olp` commands used to be audited as `admin`."""
    import getpass

    env = {"OLP_ACTOR": ""}
    assert olp(running_proxy, "freeze", "--actor", "dana@ops", **env).returncode == 0
    assert olp(running_proxy, "unfreeze", OLP_ACTOR="erik").returncode == 0
    assert olp(running_proxy, "tenant", "bob", "--training", "on", **env).returncode == 0
    assert _actors(running_proxy)[-3:] == ["dana@ops", "erik", getpass.getuser()]
    bad = olp(running_proxy, "freeze", "--actor", "ops\nforged", **env)
    assert bad.returncode == 1 and "actor" in bad.stderr and "Traceback" not in bad.stderr
    assert _actors(running_proxy)[-1] == getpass.getuser()  # nothing was changed


def test_an_admin_key_with_a_line_end_works_and_one_no_header_carries_is_one_line(
    running_proxy: ProxyHarness,
) -> None:
    """A key read from a file saved with CRLF (`key\r`), or one with a non-ASCII character,
    made http.client raise: a traceback holding the whole header, the key included."""
    assert olp(running_proxy, "status", OLP_ADMIN_KEY=ADMIN_KEY + "\r\n").returncode == 0
    for bad in ("\u043a\u043b\u044e\u0447-secret", "ab\x07cd-secret"):
        done = olp(running_proxy, "status", OLP_ADMIN_KEY=bad)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and "secret" not in done.stderr
        assert done.stderr.startswith("olp: the admin key holds a character")


def test_tenant_training_switch_on_and_back_to_the_config(running_proxy: ProxyHarness) -> None:
    on = olp(running_proxy, "tenant", "bob", "--training", "on")
    assert on.returncode == 0 and on.stdout == "tenant bob: online training enabled\n"
    assert "tenant bob: training on (set at run time)" in olp(running_proxy, "status").stdout
    back = olp(running_proxy, "tenant", "bob", "--training", "config")
    assert back.returncode == 0, back.stderr
    assert back.stdout == "tenant bob: online training disabled, as the config says\n"
    assert "tenant bob: training off" in olp(running_proxy, "status").stdout.splitlines()


def test_the_up_banner_names_a_run_time_training_switch(tmp_path: Path, monkeypatch) -> None:
    """It said "off in the config" of a tenant that a switch kept training on."""
    from deploy.config import load_config
    from deploy.supervisor import Stack
    from proxy.serving_state import ServingState, save_state

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    stack = Stack(load_config(), None, with_learner=False)
    tenant = stack.cfg.tenants[0].name
    assert f"tenant '{tenant}' is off in the config" in stack.banner(1.0)
    switch = {"enabled": True, "config_enabled": False}
    state = ServingState(aliases={}, tenant_training={tenant: switch})
    save_state(stack.state_dir / stack.cfg.proxy.state.serving_state, state)
    banner = stack.banner(1.0)
    assert f"tenant '{tenant}' is on, switched at run time (off in the config)" in banner
    assert f"olp tenant {tenant} --training config" in banner


def test_the_up_banner_names_urls_a_client_here_can_call(tmp_path: Path, monkeypatch) -> None:
    """Bound to every interface, the banner said `http://0.0.0.0:8000/v1`: no address to
    call, and one the proxy's Host check refuses once proxy.allowed_hosts is set."""
    from deploy.config import load_config
    from deploy.supervisor import Stack

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("OLP_PROXY__HOST", "0.0.0.0")
    banner = Stack(load_config(), None, with_learner=False).banner(1.0)
    assert "OpenAI base URL  http://127.0.0.1:8000/v1" in banner
    assert "operator page    http://127.0.0.1:8000/admin/ui" in banner and "0.0.0.0" not in banner


def test_ui_prints_a_one_time_link_that_signs_the_operator_in(
    running_proxy: ProxyHarness,
) -> None:
    import httpx

    done = olp(running_proxy, "ui", "--actor", "night-ops")
    assert done.returncode == 0, done.stderr
    url = done.stdout.strip()
    assert url.startswith(f"http://127.0.0.1:{running_proxy.port}/admin/ui/login?token=")
    assert ADMIN_KEY not in url and "one use" in done.stderr
    browser = {"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    with httpx.Client() as client:
        signed_in = client.get(url, headers=browser)
        assert signed_in.status_code == 303
        page = client.get(f"http://127.0.0.1:{running_proxy.port}/admin/ui")
        assert page.status_code == 200 and "night-ops" in page.text
    wrong = olp(running_proxy, "ui", OLP_ADMIN_KEY="not-the-key")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr and not wrong.stdout


def test_status_into_a_reader_that_stops_early_is_no_traceback(
    running_proxy: ProxyHarness,
) -> None:
    """`olp status | head -1` ended with a BrokenPipeError traceback."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OLP_PROXY__PORT": str(running_proxy.port),
        "OLP_ADMIN_KEY": ADMIN_KEY,
    }
    # The reader closes before the first write: a pipe buffer cannot hide the EPIPE.
    done = subprocess.run(
        f"{sys.executable} -m deploy.cli status --json | (exec 0<&-; sleep 0)",
        shell=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
