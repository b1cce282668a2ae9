"""The proxy process's garbage-collector settings (proxy.gc).

`tune_gc` changes process-wide state, so it runs in a fresh interpreter here; the test
process keeps the interpreter's settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from proxy.config import GcTuning, ProxyConfig

PROBE = """
import gc, json, sys
from proxy.config import GcTuning
from proxy.gc_tuning import tune_gc
before = gc.get_threshold()
junk = [[i] for i in range(5000)]
frozen = tune_gc(GcTuning.model_validate_json(sys.argv[1]))
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "freeze_count": gc.get_freeze_count()}))
"""


def _probe(settings: GcTuning) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, settings.model_dump_json()],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_defaults_freeze_start_up_objects_and_raise_the_young_threshold() -> None:
    result = _probe(GcTuning())
    assert result["after"] == [20_000, *result["before"][1:]]
    # Everything alive at start-up (here the 5,000 lists and the imported modules) is frozen.
    assert result["frozen"] > 5_000 and result["freeze_count"] > 5_000


def test_disabled_settings_leave_the_interpreter_as_it_was() -> None:
    result = _probe(GcTuning(freeze_after_start=False, young_threshold=0))
    assert result["after"] == result["before"]
    assert result["frozen"] == result["freeze_count"] == 0


def test_bad_settings_are_refused_at_start_up() -> None:
    with pytest.raises(ValidationError, match="young_threshold"):
        ProxyConfig(gc={"young_threshold": -1})
    with pytest.raises(ValidationError, match="extra"):
        ProxyConfig(gc={"freeze": True})
