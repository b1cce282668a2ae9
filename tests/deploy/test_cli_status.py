"""`olp status` and the operator commands against a running proxy (in-process, no upstream
needed: the status and freeze routes do not call one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.cli_ops import format_history_entry
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


def test_status_shows_what_the_proxy_reports(running_proxy: ProxyHarness) -> None:
    done = olp(running_proxy, "freeze", "--learning")
    assert done.returncode == 0, done.stderr
    done = olp(running_proxy, "status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "serving: base   frozen: True   learning frozen: True"
    assert "aliases: policy -> base, base -> base" in lines
    assert "tenant alice: training on" in lines and "tenant bob: training off" in lines
    assert any(line.startswith("upstreams: http://127.0.0.1:") for line in lines)
    history = lines[lines.index("history (newest last):") + 1 :]
    # Readable like `olp audit show`: time, actor, change (it was the raw JSON entry).
    assert re.fullmatch(r"  \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \S+ freeze learning=true", history[-1])


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
