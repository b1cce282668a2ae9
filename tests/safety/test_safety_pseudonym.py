"""Keyed pseudonyms: a reader of the topics or the logs cannot test guessed addresses."""

from __future__ import annotations

import hashlib
import multiprocessing
import stat
from pathlib import Path
from typing import Any

import pytest

from safety.pseudonym import KEY_FILE, deployment_key, pseudonym


def test_a_pseudonym_is_keyed_and_stable() -> None:
    address = "alice@example.com"
    plain = hashlib.sha256(address.encode()).hexdigest()
    assert pseudonym(None, address) == plain  # library use without a deployment
    keyed = pseudonym(b"k" * 32, address)
    assert keyed != plain and len(keyed) == 64
    assert keyed == pseudonym(b"k" * 32, address)  # the same label joins
    assert keyed != pseudonym(b"j" * 32, address)
    assert pseudonym(b"k" * 32, "\ud800")  # header text with lone surrogates


def test_the_deployment_key_is_made_once_kept_private_and_reused(tmp_path: Path) -> None:
    first = deployment_key(tmp_path / "control")
    path = tmp_path / "control" / KEY_FILE
    assert len(first) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert deployment_key(tmp_path / "control") == first  # a restart keeps its pseudonyms
    assert deployment_key(tmp_path / "elsewhere", "shared-key-of-all-proxies") == (
        b"shared-key-of-all-proxies"
    )
    path.write_text("not hex")
    with pytest.raises(ValueError, match="does not hold a pseudonym key"):
        deployment_key(tmp_path / "control")


def _take_key(directory: str, barrier: Any, keys: Any) -> None:
    barrier.wait()
    try:
        keys.put(deployment_key(Path(directory)).hex())
    except ValueError as exc:
        keys.put(f"error: {exc}")


def test_processes_making_the_key_at_once_all_take_the_same_whole_one(tmp_path: Path) -> None:
    """Created empty and written after, the key was read empty by a process that found it
    meanwhile ("does not hold a pseudonym key", 97 starts in 200), and a crash between the
    two left an empty key that blocked every later start."""
    context = multiprocessing.get_context("fork")
    for trial in range(5):
        directory = tmp_path / str(trial)
        barrier, keys = context.Barrier(3), context.Queue()
        workers = [
            context.Process(target=_take_key, args=(str(directory), barrier, keys))
            for _ in range(3)
        ]
        for worker in workers:
            worker.start()
        taken = {keys.get(timeout=30) for _ in workers}
        for worker in workers:
            worker.join(30)
        assert taken == {(directory / KEY_FILE).read_text()}
        assert [p.name for p in directory.iterdir()] == [KEY_FILE]  # no temporary left


def test_a_file_system_without_hard_links_still_gets_a_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*_: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("safety.pseudonym.os.link", no_links)
    key = deployment_key(tmp_path)
    assert (tmp_path / KEY_FILE).read_text() == key.hex()
    assert deployment_key(tmp_path) == key
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]
