"""docs/configuration.md must match the config models; the shipped default config must load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from deploy import config_docs
from deploy.config import (
    DEFAULT_CONFIG_FILE,
    ConfigError,
    OlpConfig,
    env_overrides,
    load_config,
    validate,
)
from proxy.config import ProxyConfig, TenantConfig, sha256_hex

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the model tree, list entries written `name[]`, walked independently."""
    paths = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        paths.append(dotted)
        annotation: Any = field.annotation
        item = getattr(annotation, "__args__", (None,))[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths += _leaf_paths(annotation, f"{dotted}.")
        elif isinstance(item, type) and issubclass(item, BaseModel):
            paths += _leaf_paths(item, f"{dotted}[].")
    return paths


def _models(model: type[BaseModel]) -> set[type[BaseModel]]:
    found = {model}
    for section in config_docs.walk(model, [], True):
        found.add(section.model)
    return found


def test_configuration_md_matches_the_models() -> None:
    expected = config_docs.render()
    actual = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert actual == expected, (
        "docs/configuration.md is out of date with the config models; regenerate it with\n"
        f"    {config_docs.REGENERATE}"
    )


def test_every_key_is_documented_with_its_env_override() -> None:
    text = config_docs.render()
    keys = {key.dotted: key for key in config_docs.all_keys()}
    assert set(keys) == set(_leaf_paths(OlpConfig))
    for dotted, key in keys.items():
        assert f"| `{dotted}` |" in text
        if key.env:
            assert f"`{key.env}`" in text
    assert keys["proxy.port"].env == "OLP_PROXY__PORT"
    assert keys["state_dir"].env == "OLP_STATE_DIR"
    assert keys["tenants[].name"].env is None  # list entries cannot be set from the environment


def test_documented_env_names_reach_their_key() -> None:
    """Each documented override, read by deploy.config.env_overrides, lands on its own key."""
    checked = 0
    for key in config_docs.all_keys():
        if key.env is None:
            continue
        checked += 1
        tree = env_overrides({key.env: "x"})
        path = []
        node: Any = tree
        while isinstance(node, dict):
            (name,) = node
            path.append(name)
            node = node[name]
        assert ".".join(path) == key.dotted, key.env
    assert checked > 50, checked  # every section's keys, not a few


def test_docs_are_machine_independent() -> None:
    text = config_docs.render()
    assert str(config_docs.PROJECT_ROOT) not in text
    assert "<olp>/safety/probes/kl_prompts.jsonl" in text


def test_every_model_with_validators_has_its_rules_noted() -> None:
    with_validators = {
        model.__name__
        for model in _models(OlpConfig)
        if model.__pydantic_decorators__.model_validators
        or model.__pydantic_decorators__.field_validators
    }
    missing = with_validators - set(config_docs.NOTES)
    assert not missing, f"add the validation rules of {sorted(missing)} to config_docs.NOTES"
    assert set(config_docs.NOTES) <= {m.__name__ for m in _models(OlpConfig)}


def test_noted_plaintext_key_aliases_behave_as_documented(tmp_path: Path) -> None:
    proxy = ProxyConfig.model_validate({"admin_key": "k"})
    assert proxy.admin_key_sha256 == sha256_hex("k")
    tenant = TenantConfig.model_validate({"name": "t", "api_key": "k"})
    assert tenant.api_key_sha256 == sha256_hex("k")
    no_digest = tmp_path / "olp.yaml"
    no_digest.write_text("proxy:\n  port: 8000\n")
    cfg = load_config(no_digest, environ={"OLP_PROXY__ADMIN_KEY": "from-env"})
    assert cfg.proxy.admin_key_sha256 == sha256_hex("from-env")
    cfg = load_config(DEFAULT_CONFIG_FILE, environ={"OLP_PROXY__ADMIN_KEY": "from-env"})
    assert cfg.proxy.admin_key_sha256 == sha256_hex("from-env")
    both = tmp_path / "both.yaml"
    both.write_text(f"proxy:\n  admin_key: a\n  admin_key_sha256: {sha256_hex('b')}\n")
    with pytest.raises(ConfigError, match="not two different keys"):
        load_config(both, environ={})
    cfg = load_config(DEFAULT_CONFIG_FILE, environ={"OLP_PROXY__ADMIN_KEY_SHA256": "a" * 64})
    assert cfg.proxy.admin_key_sha256 == "a" * 64


def test_default_config_validates() -> None:
    raw = yaml.safe_load(DEFAULT_CONFIG_FILE.read_text())
    cfg = validate(OlpConfig, raw)
    assert cfg == load_config(DEFAULT_CONFIG_FILE, environ={})
    documented = {key.dotted for key in config_docs.all_keys()}
    for section, values in raw.items():
        assert section in documented
        if isinstance(values, dict):
            assert {f"{section}.{k}" for k in values} <= documented
