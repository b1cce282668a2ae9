"""Keyed pseudonyms: a reader of the topics or the logs cannot test guessed addresses."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

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
