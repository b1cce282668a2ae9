"""`GET /admin/status` reports the gate's recent decisions, read from the learner's
`gates/policy-v<N>.json` (in-process proxy, no upstream: the status route calls none)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from proxy.operator_data import recent_gate_decisions
from tests.proxy.conftest import ADMIN_KEY

NO_UPSTREAM = ["http://127.0.0.1:9"]


def _result(name, metric, threshold, verdict, comparison="<=", details=None) -> dict:
    return {
        "name": name,
        "metric": metric,
        "threshold": threshold,
        "comparison": comparison,
        "verdict": verdict,
        "details": details or {"samples": ["a long list the status must not carry"] * 50},
    }


def _report(version: int, passed: bool, results: list[dict], **fields) -> dict:
    return {
        "passed": passed,
        "candidate": f"policy-v{version}",
        "incumbent": f"policy-v{version - 1}",
        "base": "base",
        "started_at": 1_700_000_000.0 + version,
        "duration_s": 10.0 * version,
        "failed_gates": [r["name"] for r in results if r["verdict"] != "pass"],
        "results": results,
        **fields,
    }


def write_reports(gates: Path) -> None:
    """v1..v6 and the files that are not reports: the status shows v2..v6."""
    gates.mkdir(parents=True)
    kl_pass = _result("kl_to_base", 0.01, 0.05, "pass")
    reports = {
        1: _report(1, True, [kl_pass]),
        2: _report(2, True, [kl_pass]),
        3: _report(3, False, [kl_pass, _result("poisoning", 0.666667, 0.5, "fail")]),
        4: _report(
            4,
            False,
            [
                {
                    "name": "safety_probes",
                    "metric": None,
                    "threshold": None,
                    "comparison": "<=",
                    "verdict": "fail",
                    "details": {"reason": "GateError: upstream answered 502\n" + "x" * 500},
                }
            ],
        ),
        # NaN is what json.loads reads and strict JSON cannot carry; `results` is no list.
        6: {"passed": "yes", "started_at": float("nan"), "duration_s": 3.5, "results": "?"},
    }
    for version, report in reports.items():
        (gates / f"policy-v{version}.json").write_text(json.dumps(report))
    (gates / "policy-v5.json").write_text("{half a report")  # damaged, not a write in progress
    (gates / "policy-v7.tmp").write_text('{"passed": tr')  # the learner is writing it
    (gates / "notes.txt").write_bytes(b"\xff\xfe not json")
    (gates / "policy-vX.json").write_text("[]")


def status(harness) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.get(harness.base_url + "/admin/status", headers=headers, timeout=30)


def test_status_lists_recent_gate_decisions_and_survives_bad_files(make_proxy, tmp_path):
    harness, _ = make_proxy(NO_UPSTREAM)
    before = status(harness)
    assert before.status_code == 200 and before.json()["gates"] == []  # no gates dir yet

    write_reports(tmp_path / "state" / "gates")
    response = status(harness)
    assert response.status_code == 200, response.text
    assert "NaN" not in response.text  # strict JSON, whatever the report held
    gates = response.json()["gates"]
    assert [g["version"] for g in gates] == [f"policy-v{n}" for n in (2, 3, 4, 5, 6)]
    v2, v3, v4, v5, v6 = gates
    assert v2 == {
        "version": "policy-v2",
        "passed": True,
        "started_at": 1_700_000_002.0,
        "duration_s": 20.0,
        "failed": [],
        "error": None,
    }
    assert v3["passed"] is False and v3["failed"] == [
        {
            "name": "poisoning",
            "metric": 0.666667,
            "comparison": "<=",
            "threshold": 0.5,
            "reason": None,
        }
    ]
    assert v4["passed"] is False
    (closed,) = v4["failed"]
    assert closed["name"] == "safety_probes" and closed["metric"] is None
    assert closed["reason"] == "GateError: upstream answered 502"  # first line only
    assert v5["passed"] is None and v5["error"] and v5["failed"] == []
    assert v6["passed"] is False  # "yes" is not a pass
    assert v6["started_at"] is None and v6["duration_s"] == 3.5 and v6["failed"] == []
    assert "samples" not in response.text  # the decision, not the details


def test_a_report_pruned_while_being_read_is_skipped(tmp_path, monkeypatch):
    """The learner removes the reports of pruned versions: one gone between the listing and
    the read is no error, and the next older report takes its place."""
    gates = tmp_path / "gates"
    write_reports(gates)
    read_text = Path.read_text

    def pruned_first(self: Path, *args, **kwargs) -> str:
        if self.name == "policy-v6.json":
            self.unlink()
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", pruned_first)
    decisions = recent_gate_decisions(tmp_path, 5)
    assert [d["version"] for d in decisions] == [f"policy-v{n}" for n in (1, 2, 3, 4, 5)]
    assert [d["error"] is None for d in decisions] == [True, True, True, True, False]
