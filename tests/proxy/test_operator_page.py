"""The operator page (/admin/ui): auth, one-time links, content, escaping, audit verify, and a
real headless Chromium run against a proxy in front of the real vLLM and Kafka."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from proxy.aliases import Canary
from proxy.config import TenantConfig
from proxy.operator_auth import clean_actor
from proxy.operator_data import consumer_lag, topic_end_offsets
from proxy.operator_page import MAX_FORM_BYTES, OPERATOR
from replay.config import StreamConfig
from replay.producer import KafkaSink
from replay.synthetic import make_feedback, make_trajectory
from safety.audit import AuditLog, canonical_json
from tests.proxy.conftest import ADMIN_KEY, KEYS, ProxyHarness, default_tenants

NO_UPSTREAM = ["http://127.0.0.1:9"]  # the page needs no replica
BEARER = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# What a browser sends when it opens a link itself (Fetch Metadata).
# A typed link (`Sec-Fetch-Site: none`), as a browser sends it to a loopback origin.
NAVIGATION = {
    "Sec-Fetch-Mode": "navigate",
    "Sec-Fetch-Dest": "document",
    "Sec-Fetch-User": "?1",
    "Sec-Fetch-Site": "none",
}


def mint_link(harness: ProxyHarness, actor: str = "ops-test") -> dict:
    resp = httpx.post(harness.base_url + "/admin/ui/link", headers={**BEARER, "X-OLP-Actor": actor})
    assert resp.status_code == 200, resp.text
    return resp.json()


def signed_in_client(harness: ProxyHarness) -> httpx.Client:
    client = httpx.Client(base_url=harness.base_url)
    resp = client.get(mint_link(harness)["path"], headers=NAVIGATION)
    assert resp.status_code == 303 and resp.headers["location"] == "/admin/ui"
    return client


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "the page has no CSRF field"
    return match.group(1)


def test_refused_without_auth_shows_no_data(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    for method, path in (("GET", "/admin/ui"), ("POST", "/admin/ui/verify")):
        resp = httpx.request(method, harness.base_url + path)
        assert resp.status_code == 401, path
        assert resp.headers["content-type"].startswith("text/html")
        assert 'id="login"' in resp.text and 'action="/admin/ui/login"' in resp.text
        for leak in ("alice", "serving-version", "reward-chart", "audit-records", ADMIN_KEY):
            assert leak not in resp.text, leak
    wrong = httpx.get(harness.base_url + "/admin/ui", headers={"Authorization": "Bearer nope"})
    tenant = httpx.get(
        harness.base_url + "/admin/ui", headers={"Authorization": f"Bearer {KEYS['alice']}"}
    )
    assert wrong.status_code == tenant.status_code == 403
    assert "alice" not in tenant.text
    assert httpx.post(harness.base_url + "/admin/ui/link").status_code == 401
    no_admin, _ = make_proxy(NO_UPSTREAM, admin_key=None)
    assert httpx.get(no_admin.base_url + "/admin/ui", headers=BEARER).status_code == 403


def test_bearer_key_renders_the_page_with_a_strict_csp(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    resp = httpx.get(harness.base_url + "/admin/ui", headers=BEARER)
    assert resp.status_code == 200
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp and "unsafe" not in csp
    assert resp.headers["cache-control"] == "no-store"
    page = resp.text
    assert '<strong id="serving-version">base</strong>' in page
    for tenant in ("alice", "bob", "carol"):
        assert f"<td>{tenant}</td>" in page
    assert "<script" not in page and ADMIN_KEY not in page
    assert 'id="reward-chart"' in page and "no rewards yet" in page
    assert "does not write to Kafka" in page  # CollectingSink: no stream metrics


def test_the_page_says_which_tenants_were_switched_at_run_time(make_proxy):
    """`olp status` says "training on (set at run time)"; the page showed a tenant switched
    on at run time exactly like one its config turns on."""
    harness, _ = make_proxy(NO_UPSTREAM)
    switched = httpx.post(
        harness.base_url + "/admin/tenants/bob/training", json={"enabled": True}, headers=BEARER
    )
    assert switched.status_code == 200, switched.text
    page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER).text
    assert "<th>set by</th>" in page
    assert '<tr><td>alice</td><td><span class="ok">on</span></td><td>config</td>' in page
    assert '<tr><td>bob</td><td><span class="ok">on</span></td><td>run time</td>' in page


def test_one_time_link_works_once_and_expires(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    link = mint_link(harness, actor="night-shift")
    assert link["url"] == harness.base_url + link["path"]
    assert link["path"].startswith("/admin/ui/login?token=") and ADMIN_KEY not in link["url"]
    client = httpx.Client(base_url=harness.base_url)
    first = client.get(link["path"], headers=NAVIGATION)
    assert first.status_code == 303
    cookie = first.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/admin/ui" in cookie
    page = client.get("/admin/ui")
    assert page.status_code == 200 and "night-shift" in page.text
    assert httpx.get(link["url"], headers=NAVIGATION).status_code == 401  # used
    assert httpx.get(link["url"]).status_code == 401  # no confirmation page for it either
    harness.app[OPERATOR].sessions.link_ttl_s = 0.05
    stale = mint_link(harness)
    time.sleep(0.1)
    expired = httpx.get(stale["url"], headers=NAVIGATION)
    assert expired.status_code == 401 and "expired" in expired.text
    logins = [r for r in harness.ctx.audit.iter_records() if r["event"] == "operator_login"]
    assert [(r["actor"], r["payload"]["method"]) for r in logins] == [("night-shift", "link")]
    assert link["path"].split("=", 1)[1] not in harness.ctx.audit.path.read_text()


def test_login_form_sets_the_session_cookie(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    client = httpx.Client(base_url=harness.base_url)
    wrong = client.post("/admin/ui/login", data={"key": "guess", "actor": "x"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert client.get("/admin/ui").status_code == 401
    ok = client.post("/admin/ui/login", data={"key": ADMIN_KEY, "actor": "form-op"})
    assert ok.status_code == 303 and "HttpOnly" in ok.headers["set-cookie"]
    page = client.get("/admin/ui")
    assert page.status_code == 200 and "form-op" in page.text
    logout = client.post("/admin/ui/logout", data={"csrf": csrf_of(page.text)})
    assert logout.status_code == 200
    assert client.get("/admin/ui").status_code == 401
    audit = harness.ctx.audit.path.read_text()
    assert "form-op" in audit and ADMIN_KEY not in audit


def test_a_sign_in_the_audit_log_cannot_record_is_refused_on_a_page(make_proxy):
    """A damaged audit log gave the browser the middleware's JSON 500 on every sign-in; now
    a page says why and what to run, and no session opens unrecorded."""
    harness, _ = make_proxy(NO_UPSTREAM)
    link = mint_link(harness)  # audited while the log is whole
    with harness.ctx.audit.path.open("ab") as log_file:
        log_file.write(b'{"seq": 99, "damaged": true}\n')
    client = httpx.Client(base_url=harness.base_url)
    for refused in (
        client.get(link["path"], headers=NAVIGATION),
        client.post("/admin/ui/login", data={"key": ADMIN_KEY, "actor": "form-op"}),
    ):
        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"].startswith("text/html")
        assert "olp audit verify" in refused.text and "set-cookie" not in refused.headers
    assert client.get("/admin/ui").status_code == 401
    assert httpx.get(harness.base_url + "/admin/ui", headers=BEARER).status_code == 200


def test_bytes_that_are_not_utf8_are_refused_not_a_500(make_proxy):
    """aiohttp raises on a form that is not UTF-8 and decodes such header bytes to lone
    surrogates; both are a plain refusal."""
    harness, _ = make_proxy(NO_UPSTREAM)
    client = httpx.Client(base_url=harness.base_url)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    login = client.post("/admin/ui/login", content=b"key=\xff\xfe", headers=form)
    assert login.status_code == 400 and "set-cookie" not in login.headers
    bearer = client.get("/admin/ui", headers={"Authorization": b"Bearer \xff"})
    assert bearer.status_code == 403
    signed_in = signed_in_client(harness)
    csrf = csrf_of(signed_in.get("/admin/ui").text)
    body = b"csrf=" + csrf.encode() + b"\xff"
    logout = signed_in.post("/admin/ui/logout", content=body, headers=form)
    assert logout.status_code == 400
    assert signed_in.get("/admin/ui").status_code == 200  # still signed in


def test_verify_button_shows_ok_then_the_first_bad_seq(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    for path in ("/admin/freeze", "/admin/unfreeze"):
        assert httpx.post(harness.base_url + path, headers=BEARER, json={}).status_code == 200
    client = signed_in_client(harness)  # seq 3: operator_login
    csrf = csrf_of(client.get("/admin/ui").text)
    forged = client.post("/admin/ui/verify", data={"csrf": "not-the-token"})
    assert forged.status_code == 403 and "verify-result" not in forged.text
    ok = client.post("/admin/ui/verify", data={"csrf": csrf})
    assert ok.status_code == 200
    assert 'data-ok="true"' in ok.text and "Chain OK: 3 records" in ok.text

    audit_file = Path(harness.ctx.audit.path)
    lines = audit_file.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    record["payload"] = {"tampered": True}
    lines[1] = canonical_json(record) + b"\n"
    audit_file.write_bytes(b"".join(lines))
    broken = client.post("/admin/ui/verify", data={"csrf": csrf})
    assert 'data-first-bad-seq="2"' in broken.text and "hash mismatch" in broken.text


def test_an_operator_named_by_an_e_mail_is_logged_as_the_audit_names_them(make_proxy):
    """The audit log writes an e-mail actor as a pseudonym; the proxy's log line of a
    verify wrote the address itself."""
    from structlog.testing import capture_logs

    harness, _ = make_proxy(NO_UPSTREAM)
    headers = {**BEARER, "X-OLP-Actor": "alice@example.com"}
    with capture_logs() as logs:
        verified = httpx.post(harness.base_url + "/admin/ui/verify", headers=headers)
    assert verified.status_code == 200
    [line] = [e for e in logs if e["event"] == "operator_audit_verified"]
    assert line["actor"].startswith("redacted-") and "alice" not in str(logs)


def test_verify_button_on_an_emptied_log_is_not_ok(make_proxy):
    """A log emptied together with its head passes the chain check with 0 records: the page
    says there was nothing to verify, as `olp audit verify` does (exit 2), not "Chain OK"."""
    harness, _ = make_proxy(NO_UPSTREAM)
    client = signed_in_client(harness)  # seq 1: operator_login
    csrf = csrf_of(client.get("/admin/ui").text)
    audit_file = Path(harness.ctx.audit.path)
    audit_file.write_bytes(b"")
    Path(f"{audit_file}.head").unlink()
    emptied = client.post("/admin/ui/verify", data={"csrf": csrf})
    assert emptied.status_code == 200
    assert 'data-ok="false"' in emptied.text and "Chain OK" not in emptied.text
    assert "proves nothing" in emptied.text


def test_untrusted_names_and_payloads_are_escaped(make_proxy, tmp_path):
    evil_tenant = '<script>alert("tenant")</script>'
    tenants = [*default_tenants(), TenantConfig(name=evil_tenant, api_key="evil-key")]
    harness, _ = make_proxy(NO_UPSTREAM, tenants=tenants)
    evil_alias = "<img src=x onerror=alert(1)>"
    harness.ctx.aliases.set(evil_alias, "base")
    harness.ctx.aliases.start_canary(evil_alias, Canary("<u>policy-v9</u>", 0.25, 0.0))
    harness.ctx.state.record("flip", "<b>mallory</b>", alias=evil_alias, target="base")
    harness.ctx.audit.append("mallory", "<svg onload=alert(3)>", {"note": "<script>x</script>"})
    gates = tmp_path / "state" / "gates"
    gates.mkdir(parents=True)
    (gates / "policy-v1.json").write_text(
        json.dumps(
            {
                "passed": False,
                "candidate": "policy-v1",
                "incumbent": "</h3><script>y</script>",
                "results": [
                    {"name": "<i>kl</i>", "metric": 1, "threshold": 0.5, "verdict": "fail"}
                ],
            }
        )
    )
    page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER).text
    assert "<script" not in page and "<img" not in page and "<svg onload" not in page
    assert "<b>mallory" not in page and "<i>kl" not in page
    assert "&lt;script&gt;alert(&quot;tenant&quot;)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;svg onload=alert(3)&gt;" in page and "&lt;i&gt;kl&lt;/i&gt;" in page
    assert "<code>&lt;u&gt;policy-v9&lt;/u&gt;</code> for 0.25 of training traffic" in page


def test_gates_learner_rewards_and_feedback_series(make_proxy, tmp_path):
    harness, sink = make_proxy(NO_UPSTREAM)
    state = tmp_path / "state"
    for version, reward in ((1, 0.25), (2, 0.5)):
        adapter = state / "adapters" / f"policy-v{version}"
        adapter.mkdir(parents=True)
        meta = {
            "parent_version": version - 1,
            "consumed_offsets": {"olp.trajectories": {"0": 3 * version}},
            "step_metrics": {"reward_mean": reward, "kl": 0.01, "samples": 4.0},
            "created_at": time.time() - 10 + version,
        }
        (adapter / "olp_meta.json").write_text(json.dumps(meta))
    (state / "gates").mkdir()
    (state / "gates" / "policy-v2.json").write_text(
        json.dumps(
            {
                "passed": True,
                "candidate": "policy-v2",
                "incumbent": "policy-v1",
                "results": [
                    {
                        "name": "kl_to_base",
                        "metric": 0.012,
                        "threshold": 0.05,
                        "verdict": "pass",
                        "comparison": "<=",
                    }
                ],
            }
        )
    )
    (state / "gates" / "policy-v3.json").write_text("{not json")
    values = [0.1, 1.0, 0.4]
    for value in values:
        resp = httpx.post(
            harness.base_url + "/v1/feedback",
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            json={"trajectory_id": f"traj-{value}", "kind": "score", "value": value},
        )
        assert resp.status_code == 202
    accept = {"trajectory_id": "traj-x", "kind": "accept"}  # no value: not plotted
    # A value on another kind is no reward (the learner counts this one -0.5): not plotted.
    thumbs_down = {"trajectory_id": "traj-y", "kind": "thumbs_down", "value": 1}
    for event in (accept, thumbs_down):
        httpx.post(
            harness.base_url + "/v1/feedback",
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            json=event,
        )
    page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER).text
    assert 'data-feedback-points="3"' in page and 'data-learner-points="2"' in page
    assert re.findall(r'class="fb-point" data-value="([^"]+)"', page) == ["0.1", "1", "0.4"]
    assert re.findall(r'class="learner-point" data-version="([^"]+)"', page) == [
        "policy-v1",
        "policy-v2",
    ]
    assert 'class="fb-mean" data-points="3"' in page
    assert "kl_to_base" in page and 'class="pass"' in page
    assert "policy-v3.json" in page  # the unreadable report is named, not hidden
    assert len(sink.feedback) == 5


def test_odd_numbers_in_learner_files_do_not_take_the_page_down(make_proxy, tmp_path):
    """The learner writes these files; a NaN reward or a timestamp no clock can show gave a
    500 for the whole page (OverflowError / ValueError in datetime.fromtimestamp)."""
    harness, _ = make_proxy(NO_UPSTREAM)
    state = tmp_path / "state"
    odd = [(1, 0.25, time.time()), (2, float("nan"), time.time()), (3, 0.5, 1e300)]
    for version, reward, created in odd:
        adapter = state / "adapters" / f"policy-v{version}"
        adapter.mkdir(parents=True)
        meta = {"step_metrics": {"reward_mean": reward}, "created_at": created}
        (adapter / "olp_meta.json").write_text(json.dumps(meta))
    (state / "gates").mkdir()
    report = {"passed": False, "candidate": "policy-v3", "started_at": 1e300, "results": []}
    (state / "gates" / "policy-v3.json").write_text(json.dumps(report))
    # A report edited by hand (or by another version) with `details` that are not an object.
    odd_details = [
        {"name": "regression", "verdict": "fail", "details": "timed out"},
        {"name": "poisoning", "verdict": "fail", "details": ["trig-sudo"]},
    ]
    report = {"passed": False, "candidate": "policy-v2", "results": odd_details}
    (state / "gates" / "policy-v2.json").write_text(json.dumps(report))
    response = httpx.get(harness.base_url + "/admin/ui", headers=BEARER)
    assert response.status_code == 200, response.text
    page = response.text
    assert re.findall(r'class="learner-point" data-version="([^"]+)"', page) == ["policy-v1"]
    assert "1e+300" in page  # the gate report's time, shown as it is
    assert "regression" in page and "poisoning" in page


def test_odd_shapes_in_learner_files_show_next_to_their_section(make_proxy, tmp_path):
    """One odd value in a learner-written file gave a 500 for the whole page: `step_metrics`
    that is not an object, an `olp_meta.json` nested too deeply to parse (RecursionError),
    gate `results` that are not a list. Each is now named next to its section."""
    harness, _ = make_proxy(NO_UPSTREAM)
    state = tmp_path / "state"
    metas = {
        1: json.dumps({"step_metrics": [1, 2]}),
        2: "[" * 100_000 + "]" * 100_000,
        3: json.dumps({"step_metrics": {"reward_mean": 0.5}, "created_at": time.time()}),
    }
    for version, text in metas.items():
        adapter = state / "adapters" / f"policy-v{version}"
        adapter.mkdir(parents=True)
        (adapter / "olp_meta.json").write_text(text)
    (state / "gates").mkdir()
    report = {"passed": False, "candidate": "policy-v3", "results": 5}
    (state / "gates" / "policy-v3.json").write_text(json.dumps(report))
    report = {"passed": True, "candidate": "policy-v2", "results": [{"name": "kl", "verdict": 1}]}
    (state / "gates" / "policy-v2.json").write_text(json.dumps(report))
    response = httpx.get(harness.base_url + "/admin/ui", headers=BEARER)
    assert response.status_code == 200, response.text
    page = response.text
    rewards = page[page.index('id="rewards"') : page.index('id="stream"')]
    assert re.findall(r'class="learner-point" data-version="([^"]+)"', rewards) == ["policy-v3"]
    assert re.search(r'class="error">policy-v1: .*step_metrics', rewards)
    assert re.search(r'class="error">policy-v2: .*(recursion|nested)', rewards)
    gates = page[page.index('id="gates"') : page.index('id="rewards"')]
    assert re.search(r'class="error">policy-v3.json: .*results', gates)
    assert "kl" in gates  # the sound report is still shown
    status = httpx.get(harness.base_url + "/admin/status", headers=BEARER)
    assert status.status_code == 200


def test_a_section_that_cannot_be_shown_says_so_in_its_place(make_proxy, monkeypatch):
    from proxy import operator_html

    def odd(_: object) -> str:
        raise KeyError("reward_mean")

    monkeypatch.setattr(operator_html, "_chart", odd)
    harness, _ = make_proxy(NO_UPSTREAM)
    response = httpx.get(harness.base_url + "/admin/ui", headers=BEARER)
    assert response.status_code == 200, response.text
    page = response.text
    rewards = page[page.index('id="rewards"') : page.index('id="stream"')]
    assert "could not be shown: KeyError: &#x27;reward_mean&#x27;" in rewards
    assert 'id="audit"' in page and 'id="serving-version"' in page


@pytest.mark.parametrize(
    "consumed",
    ["olp.trajectories", {"olp.trajectories": [3]}, {"olp.trajectories": {"0": "x"}}],
)
def test_consumed_offsets_of_another_shape_are_named_not_a_crash(consumed) -> None:
    ends = {"olp.trajectories": {0: 5}}
    with pytest.raises(ValueError, match="consumed_offsets"):
        consumer_lag(ends, consumed)


def test_every_audit_record_is_reachable_page_by_page(make_proxy, tmp_path):
    """Paging kept at most the newest 10,000 matches (and `page` stopped at 10,000): older
    pages came back empty and the 'older' link vanished while the header counted every
    record. Now every page of the log can be reached, the oldest last."""
    audit = AuditLog(tmp_path / "state" / "audit" / "audit.jsonl", fsync=False)
    for index in range(10_060):
        audit.append("seed", "freeze" if index % 2 else "unfreeze", {"i": index})
    harness, _ = make_proxy(NO_UPSTREAM)

    def shown(query: str) -> tuple[list[int], bool]:
        page = httpx.get(f"{harness.base_url}/admin/ui?{query}", headers=BEARER).text
        assert "10060 records in the log" in page
        seqs = re.findall(r"<tr><td>(\d+)</td>", page[page.index('class="audit-records"') :])
        return [int(s) for s in seqs], 'id="audit-older"' in page

    assert shown("page=0&size=50") == (list(range(10_060, 10_010, -1)), True)
    assert shown("page=200&size=50") == (list(range(60, 10, -1)), True)
    assert shown("page=201&size=50") == (list(range(10, 0, -1)), False)
    assert shown("page=202&size=50") == ([], False)
    assert shown("page=10059&size=1") == ([1], False)
    # One event: the odd seqs are `unfreeze` (index 0, 2, ...); 5,030 of them.
    assert shown("event=unfreeze&page=100&size=50") == (list(range(59, 0, -2)), False)
    assert shown("event=unfreeze&page=99&size=50")[1] is True


def test_consumer_lag_is_never_negative() -> None:
    ends = {"t.trajectories": {0: 5, 1: 2}, "t.feedback": {0: 0}}
    consumed = {"t.trajectories": {"0": 3, "1": 4}}  # the broker's end trails the learner
    rows = consumer_lag(ends, consumed)
    assert [(r["topic"], r["partition"], r["end"], r["consumed"], r["lag"]) for r in rows] == [
        ("t.feedback", 0, 0, None, 0),
        ("t.trajectories", 0, 5, 3, 2),
        ("t.trajectories", 1, 2, 4, 0),
    ]


def test_end_offsets_count_every_record_of_a_batch(kafka_bootstrap):
    """The embedded broker answers ListOffsets with its last batch's base offset + 1: three
    records sent as one batch read as an end offset of 1 there, and the page showed a lag
    of the records the learner had not read as smaller than it was."""
    topic = f"ends-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 2, 1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=200)
    try:
        sent = [producer.send(topic, value=b"r%d" % i, partition=0) for i in range(3)]
        producer.flush()
        assert [future.get(timeout=10).offset for future in sent] == [0, 1, 2]
    finally:
        producer.close()
    ends = topic_end_offsets(kafka_bootstrap, [topic, "no-such-topic"], timeout_s=5)
    assert ends == {topic: {0: 3, 1: 0}, "no-such-topic": {}}


def test_stream_section_reports_an_unreachable_broker_without_hanging(make_proxy, tmp_path):
    sink = KafkaSink(
        StreamConfig(bootstrap_servers="127.0.0.1:9", reconnect_backoff_s=60),
        tmp_path / "sink",
    )
    try:
        harness, _ = make_proxy(NO_UPSTREAM, sink=sink)
        httpx.post(
            harness.base_url + "/v1/feedback",
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            json={"trajectory_id": "t1", "kind": "score", "value": 1},
        )
        started = time.monotonic()
        page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER, timeout=30).text
        assert time.monotonic() - started < 10
        assert 'id="lag-unavailable"' in page and "no broker answers" in page
        assert 'class="stream-metrics"' in page and "spill_bytes" in page
        assert "queue_bytes" in page  # what capture_backlog_bytes limits
    finally:
        sink.close()


def test_lag_is_not_measured_against_offsets_of_another_stream(
    make_proxy, kafka_bootstrap, tmp_path
):
    """`olp up` starts a new stream with each start of its embedded broker; the newest
    version's offsets, saved in the last one, read against this one's ends as a lag of 0
    (the learner "ahead" of the log) until the next version. Named by OLP_STREAM_ID, a
    version of another stream says so and its offsets are not used."""
    prefix = f"olag-{uuid.uuid4().hex[:8]}"
    stream = StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    sink = KafkaSink(stream, tmp_path / "sink")
    try:
        harness, _ = make_proxy(NO_UPSTREAM, sink=sink)
        trajectory = make_trajectory()
        for _ in range(3):
            sink.put_feedback(make_feedback(trajectory, kind="score", value=1.0))
        assert sink.wait_idle(30)
        adapter = tmp_path / "state" / "adapters" / "policy-v1"
        adapter.mkdir(parents=True)
        consumed = {f"{prefix}.feedback": {str(p): 40 for p in range(4)}}
        meta = {"parent_version": 0, "consumed_offsets": consumed, "stream_id": "embedded-old"}
        (adapter / "olp_meta.json").write_text(json.dumps(meta))

        def feedback_rows() -> tuple[str, list[tuple[int, str, int]]]:
            page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER, timeout=30).text
            cells = r"<td>\d+</td><td>(\d+)</td><td>([^<]+)</td><td>(\d+)</td>"
            row = rf"<td>{prefix}\.feedback</td>" + cells
            return page, [(int(e), c, int(lag)) for e, c, lag in re.findall(row, page)]

        harness.ctx.stream_id = "embedded-new"
        page, rows = feedback_rows()
        assert 'id="lag-other-stream"' in page and "embedded-old" in page
        assert len(rows) == 4 and sum(end for end, _, _ in rows) == 3
        # Every record of this stream is in no version yet.
        assert all(consumed == "—" and lag == end for end, consumed, lag in rows), rows
        harness.ctx.stream_id = "embedded-old"  # the same stream: its offsets count
        page, rows = feedback_rows()
        assert 'id="lag-other-stream"' not in page
        assert [(consumed, lag) for _, consumed, lag in rows] == [("40", 0)] * 4
    finally:
        sink.close()


def chromium(*args: str, profile: Path, timeout_s: float = 90) -> subprocess.CompletedProcess:
    """Headless Chromium with a fresh profile (no cookie carries over between runs)."""
    return subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_chromium_renders_live_rewards(make_proxy, vllm_server, kafka_bootstrap, tmp_path):
    # Never skipped: `./olpw test` installs the Debian package or stops before the tests.
    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: run the suite with ./olpw test"
    prefix = f"opage-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(
        StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix), tmp_path / "sink"
    )
    try:
        harness, _ = make_proxy([vllm_server.base_url], sink=sink)
        scores = [0.2, 0.9, 0.5, 0.7]
        for i, score in enumerate(scores):
            resp = httpx.post(
                harness.base_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS['alice']}", "X-OLP-Train": "1"},
                json={
                    "model": "policy",
                    "messages": [{"role": "user", "content": f"Say a number: {i}"}],
                    "max_tokens": 8,
                },
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            feedback = httpx.post(
                harness.base_url + "/v1/feedback",
                headers={"Authorization": f"Bearer {KEYS['alice']}"},
                json={
                    "trajectory_id": resp.headers["x-olp-trajectory-id"],
                    "kind": "score",
                    "value": score,
                },
            )
            assert feedback.status_code == 202 and feedback.json()["known"] is True
        harness.drain()
        assert sink.wait_idle(30), "the records did not reach the broker"
        topics = [f"{prefix}.trajectories", f"{prefix}.feedback"]
        ends = topic_end_offsets(kafka_bootstrap, topics, timeout_s=5)
        assert {topic: sum(parts.values()) for topic, parts in ends.items()} == dict.fromkeys(
            topics, 4
        )

        dom = chromium("--dump-dom", mint_link(harness)["url"], profile=tmp_path / "p1").stdout
        assert '<strong id="serving-version">base</strong>' in dom
        assert 'data-feedback-points="4"' in dom
        plotted = re.findall(r'class="fb-point" data-value="([^"]+)"', dom)
        assert [float(v) for v in plotted] == scores
        assert 'class="fb-mean" data-points="4"' in dom
        ends: dict[str, int] = {}
        for topic, _, end in re.findall(
            rf"<td>{prefix}\.(\w+)</td><td>(\d+)</td><td>(\d+)</td>", dom
        ):
            ends[topic] = ends.get(topic, 0) + int(end)
        assert ends == {"trajectories": 4, "feedback": 4}  # end offsets read from Kafka

        refused = chromium(
            "--dump-dom", harness.base_url + "/admin/ui", profile=tmp_path / "p2"
        ).stdout
        assert 'id="refused"' in refused and 'id="login"' in refused
        assert "reward-chart" not in refused and "serving-version" not in refused
        assert "alice" not in refused

        shot = tmp_path / "operator.png"
        chromium(
            "--window-size=1280,2200",
            f"--screenshot={shot}",
            mint_link(harness)["url"],
            profile=tmp_path / "p3",
        )
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    finally:
        sink.close()


def test_a_body_in_an_unknown_charset_is_refused_not_a_500(make_proxy):
    """aiohttp decodes a form or JSON body with the charset (and a multipart part with the
    transfer encoding) the client names; one it does not know raises LookupError or
    RuntimeError, which must be a refusal like any undecodable body, not a 500."""
    harness, _ = make_proxy(NO_UPSTREAM)
    client = httpx.Client(base_url=harness.base_url)
    form = {"Content-Type": "application/x-www-form-urlencoded; charset=no-such-charset"}
    login = client.post("/admin/ui/login", content=b"key=x", headers=form)
    assert login.status_code == 400 and "set-cookie" not in login.headers
    multipart = {"Content-Type": "multipart/form-data; boundary=zz"}
    part = b'--zz\r\nContent-Disposition: form-data; name="key"\r\n'
    part += b"Content-Transfer-Encoding: no-such-encoding\r\n\r\nx\r\n--zz--\r\n"
    login = client.post("/admin/ui/login", content=part, headers=multipart)
    assert login.status_code == 400 and "set-cookie" not in login.headers
    # JSON is UTF-8 (RFC 8259 8.1) whatever charset a client names: the admin API reads it
    # as the completion endpoints do, and bytes that are not UTF-8 are refused.
    json_headers = {**BEARER, "Content-Type": "application/json; charset=no-such-charset"}
    for path in ("/admin/aliases", "/admin/tenants/alice/training"):
        resp = client.post(path, content=b'{"x": "\xe9"}', headers=json_headers)
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_json"
    assert harness.ctx.state.frozen is False
    resp = client.post("/admin/freeze", content=b"{}", headers=json_headers)
    assert resp.status_code == 200 and harness.ctx.state.frozen is True


def test_an_actor_with_a_trailing_newline_is_not_taken():
    """`$` matches before a final newline: the actor rule must match the whole name, or a
    form's `ops\\n` reaches the audit log, the session and console log lines."""
    assert clean_actor("ops\n") == "operator"
    assert clean_actor("night-shift") == "night-shift"


def test_the_login_forms_actor_is_checked_whole(make_proxy):
    harness, _ = make_proxy(NO_UPSTREAM)
    client = httpx.Client(base_url=harness.base_url)
    ok = client.post("/admin/ui/login", data={"key": ADMIN_KEY, "actor": "ops\n"})
    assert ok.status_code == 303
    logins = [r for r in harness.ctx.audit.iter_records() if r["event"] == "operator_login"]
    assert [r["actor"] for r in logins] == ["operator"]


def test_a_csrf_token_that_is_not_ascii_is_a_403_not_a_500(make_proxy):
    """hmac.compare_digest raises TypeError on str with non-ASCII characters."""
    harness, _ = make_proxy(NO_UPSTREAM)
    client = signed_in_client(harness)
    for path in ("/admin/ui/logout", "/admin/ui/verify"):
        resp = client.post(path, data={"csrf": "é"})
        assert resp.status_code == 403 and "CSRF" in resp.text, path
    assert client.get("/admin/ui").status_code == 200  # still signed in


def test_a_login_link_minted_through_a_tls_proxy_is_https(make_proxy):
    """Behind a reverse proxy that ends TLS (docs/operations.md's curl recipe through an
    HTTPS ingress), the link was http://: the one-time token crossed the network in clear,
    while the same proxy set the cookie `Secure`."""
    harness, _ = make_proxy(NO_UPSTREAM, allowed_hosts=["ops.example.com"])
    headers = {**BEARER, "X-Forwarded-Proto": "https", "Host": "ops.example.com"}
    resp = httpx.post(harness.base_url + "/admin/ui/link", headers=headers)
    assert resp.status_code == 200, resp.text
    link = resp.json()
    assert link["url"] == "https://ops.example.com" + link["path"]


def test_a_head_request_does_not_spend_a_login_link(make_proxy):
    """Link checkers and mail scanners send HEAD: it must neither burn the one-time link
    nor hand them a session cookie."""
    harness, _ = make_proxy(NO_UPSTREAM)
    link = mint_link(harness)
    head = httpx.head(link["url"])
    assert head.status_code == 405 and "set-cookie" not in head.headers
    opened = httpx.get(link["url"], headers=NAVIGATION)
    assert opened.status_code == 303 and "HttpOnly" in opened.headers["set-cookie"]


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_a_login_link_clicked_on_another_site_asks_for_a_click_here(make_proxy, site):
    """Clicked in a web chat or a ticket, the link was spent and its redirect, counted as
    the other site's, carried no `SameSite=Strict` cookie: "Sign-in required", and the
    link used up. Now the confirmation page, whose button posts from the proxy's origin."""
    harness, _ = make_proxy(NO_UPSTREAM)
    link = mint_link(harness, actor="chat-op")
    clicked = httpx.get(link["url"], headers={**NAVIGATION, "Sec-Fetch-Site": site})
    assert clicked.status_code == 200 and "set-cookie" not in clicked.headers
    assert 'id="confirm-login"' in clicked.text and "chat-op" in clicked.text
    client = httpx.Client(base_url=harness.base_url)
    token = link["path"].split("=", 1)[1]
    confirmed = client.post("/admin/ui/login/link", data={"token": token})
    assert confirmed.status_code == 303 and "HttpOnly" in confirmed.headers["set-cookie"]
    assert "chat-op" in client.get("/admin/ui").text


def test_the_sign_in_page_lets_the_browser_send_its_origin(make_proxy):
    """Under `Referrer-Policy: no-referrer` a browser posts the page's own form with
    `Origin: null`, read as another site's: over plain HTTP to another host (no Fetch
    Metadata there) every sign-in was refused. `same-origin` sends the real origin to the
    proxy itself and still no referrer elsewhere; pages with data keep `no-referrer`."""
    harness, _ = make_proxy(NO_UPSTREAM)
    form = httpx.get(harness.base_url + "/admin/ui")
    assert form.status_code == 401 and 'id="login"' in form.text
    assert form.headers["referrer-policy"] == "same-origin"
    page = httpx.get(harness.base_url + "/admin/ui", headers=BEARER)
    assert page.status_code == 200 and page.headers["referrer-policy"] == "no-referrer"
    # What a browser then sends over plain HTTP: its origin, no Fetch Metadata.
    own = httpx.post(
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY, "actor": "lan-op"},
        headers={"Origin": harness.base_url},
    )
    assert own.status_code == 303, own.text
    for other in ("null", "http://evil.example"):
        refused = httpx.post(
            harness.base_url + "/admin/ui/login",
            data={"key": ADMIN_KEY, "actor": "x"},
            headers={"Origin": other},
        )
        assert refused.status_code == 403 and "set-cookie" not in refused.headers


def test_huge_scores_do_not_blank_the_chart() -> None:
    """Any tenant may send a finite score of 1e308: the scale's range overflowed and every
    dot and the mean line were drawn at NaN until 2000 newer scores pushed them out. And a
    running total lost the small values for good after one large one had passed."""
    from learner.config import FeedbackValues
    from proxy.operator_chart import PLOT_LIMIT, Point, reward_chart, rolling_mean

    assert rolling_mean([1e17, 0.5, 0.5, 0.5], 2)[2:] == [0.5, 0.5]
    points = [Point(float(i), v, "score") for i, v in enumerate([1e308, -1e308, 0.5, 0.25])]
    svg = reward_chart(points, [], [])
    plotted = re.findall(r'class="fb-point" data-value="([^"]+)"[^>]* cy="([^"]+)"', svg)
    assert [v for v, _ in plotted] == ["1e+308", "-1e+308", "0.5", "0.25"]  # as sent
    ys = [float(y) for _, y in plotted]
    assert all(math.isfinite(y) for y in ys) and ys[0] < ys[2] < ys[1]
    mean = re.search(r'class="fb-mean" data-points="4" points="([^"]+)"', svg)
    assert mean is not None and "nan" not in mean.group(1) and "inf" not in mean.group(1)
    # The widest bounds learner.rewards.feedback allows a score, not a number of its own.
    FeedbackValues(score_min=-PLOT_LIMIT, score_max=PLOT_LIMIT)
    with pytest.raises(ValueError):
        FeedbackValues(score_max=PLOT_LIMIT * 1.001)


def test_a_link_preview_does_not_spend_a_login_link(make_proxy):
    """A chat's link preview or a mail scanner fetches the link without a browser's Fetch
    Metadata: it gets a confirmation page and no cookie, and the link still works for the
    person who clicks the page's button (once)."""
    harness, _ = make_proxy(NO_UPSTREAM)
    link = mint_link(harness, actor="preview-op")
    token = link["path"].split("=", 1)[1]
    for _ in range(2):  # previews often fetch twice
        preview = httpx.get(link["url"], headers={"User-Agent": "Slackbot-LinkExpanding 1.0"})
        assert preview.status_code == 200 and "set-cookie" not in preview.headers
        assert 'id="confirm-login"' in preview.text and "preview-op" in preview.text
        assert "serving-version" not in preview.text  # no data from the proxy's state
    client = httpx.Client(base_url=harness.base_url)
    confirmed = client.post("/admin/ui/login/link", data={"token": token})
    assert confirmed.status_code == 303 and "HttpOnly" in confirmed.headers["set-cookie"]
    page = client.get("/admin/ui")
    assert page.status_code == 200 and "preview-op" in page.text
    again = httpx.post(harness.base_url + "/admin/ui/login/link", data={"token": token})
    assert again.status_code == 401 and "set-cookie" not in again.headers
    assert httpx.get(link["url"]).status_code == 401  # spent: no confirmation page either
    for bad in ({"token": "forged"}, {}):
        refused = httpx.post(harness.base_url + "/admin/ui/login/link", data=bad)
        assert refused.status_code == 401 and "set-cookie" not in refused.headers
    logins = [r for r in harness.ctx.audit.iter_records() if r["event"] == "operator_login"]
    assert [(r["actor"], r["payload"]["method"]) for r in logins] == [("preview-op", "link")]


def test_an_oversized_or_unsized_login_form_is_refused_unread(make_proxy):
    """The sign-in form is the one body the proxy reads before any key: it must not buffer
    up to `max_body_bytes` (8 MiB) for whoever connects."""
    harness, _ = make_proxy(NO_UPSTREAM)
    client = httpx.Client(base_url=harness.base_url)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    big = b"actor=x&key=" + b"k" * (MAX_FORM_BYTES + 1)
    resp = client.post("/admin/ui/login", content=big, headers=form)
    assert resp.status_code == 413 and "set-cookie" not in resp.headers

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer encoding
        yield b"key=" + ADMIN_KEY.encode()

    chunked = client.post("/admin/ui/login", content=chunks(), headers=form)
    assert chunked.status_code == 411 and "set-cookie" not in chunked.headers
    ok = client.post("/admin/ui/login", data={"key": ADMIN_KEY, "actor": "form-op"})
    assert ok.status_code == 303


def test_the_cookie_is_secure_behind_a_tls_terminating_proxy(make_proxy):
    """Behind a reverse proxy that ends TLS the proxy sees plain HTTP; the forwarded scheme
    still marks the cookie Secure (a spoofed header only restricts the sender's own cookie)."""
    harness, _ = make_proxy(NO_UPSTREAM)
    data = {"key": ADMIN_KEY, "actor": "tls-op"}
    plain = httpx.post(harness.base_url + "/admin/ui/login", data=data)
    assert "secure" not in plain.headers["set-cookie"].lower()
    forwarded = httpx.post(
        harness.base_url + "/admin/ui/login", data=data, headers={"X-Forwarded-Proto": "https"}
    )
    assert "; Secure" in forwarded.headers["set-cookie"]
    link = httpx.get(
        mint_link(harness)["url"], headers={**NAVIGATION, "X-Forwarded-Proto": "https"}
    )
    assert "; Secure" in link.headers["set-cookie"]
