"""The repository stays `ruff` clean (lint and format), checked with every test run: a line
over the limit reached a commit once because only the suite ran before it."""

from __future__ import annotations

import pytest

from tests.python_run import run_python


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_repository_is_ruff_clean(command: list[str]) -> None:
    result = run_python("-m", "ruff", *command, ".")
    assert result.returncode == 0, result.stdout + result.stderr
