"""Minimal async client for the parts of vLLM's OpenAI-compatible API the gates need:
greedy/seeded chat sampling with token ids and logprobs, and scoring fixed token ids (so KL
is computed on the exact sampled ids, never on re-tokenised text)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from safety.gates.types import GateError

# How long an idle connection to vLLM is reused: below vLLM's own keep-alive (5 s,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so that a request never goes out on a connection vLLM is
# closing. The learner's replica client uses it too.
VLLM_SAFE_KEEPALIVE_S = 4.0


class UpstreamError(GateError):
    """The model server refused or failed a request."""


class UpstreamUnavailable(UpstreamError):
    """The model server did not answer (connection refused or dropped, a timeout, a 5xx):
    nothing about the models was measured. The suite marks the gates it failed
    `unreachable`, and a report failed by nothing else is no verdict on the candidate (the
    promoter defers it, as it does an outage while loading it)."""


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    prompt_token_ids: list[int]
    finish_reason: str | None


class VllmClient:
    """One aiohttp session, a concurrency limit, and errors that say what went wrong."""

    def __init__(
        self,
        base_url: str,
        *,
        max_concurrency: int = 8,
        timeout_s: float = 180.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self._limit = asyncio.Semaphore(max_concurrency)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Idle connections are dropped before vLLM's own keep-alive (5 s) closes them:
            # with aiohttp's 15 s, a gate request sent ~5 s after the last one on its
            # connection could meet a closing socket and fail its gate.
            connector = aiohttp.TCPConnector(keepalive_timeout=VLLM_SAFE_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, headers=self._headers
            )
        return self._session

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        async with self._limit:
            try:
                async with self.session.post(url, json=body) as response:
                    text = await response.text()
                    if response.status != 200:
                        error = UpstreamUnavailable if response.status >= 500 else UpstreamError
                        raise error(
                            f"POST {path} model={body.get('model')!r} -> HTTP {response.status}: "
                            f"{text[:300]}"
                        )
            except TimeoutError as exc:  # its text is empty: say what ran out
                raise UpstreamUnavailable(
                    f"POST {path} model={body.get('model')!r} failed: no answer within "
                    f"{self._timeout.total:g} s (TimeoutError)"
                ) from exc
            except aiohttp.ClientError as exc:
                raise UpstreamUnavailable(
                    f"POST {path} model={body.get('model')!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        try:
            return json.loads(text)
        except ValueError as exc:
            raise UpstreamError(f"POST {path} returned non-JSON: {text[:200]}") from exc

    async def chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int | None,
        logprobs: bool = False,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> Completion:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
        }
        # Unset, vLLM's `--generation-config auto` fills them from the model's defaults.
        if top_p is not None:
            body["top_p"] = top_p
        if top_k is not None:
            body["top_k"] = top_k
        if seed is not None:
            body["seed"] = seed
        if logprobs:
            body["logprobs"] = True
        data = await self.post("/v1/chat/completions", body)
        try:
            choice = data["choices"][0]
            if choice.get("token_ids") is None:
                # The gates compare token sequences; an empty stand-in would make every
                # comparison vacuous and a gate pass without evidence.
                raise UpstreamError(
                    f"{model!r} returned no token_ids (the gates need a vLLM that honours "
                    "return_token_ids)"
                )
            token_logprobs = None
            if logprobs:
                token_logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
            return Completion(
                text=choice["message"].get("content") or "",
                token_ids=list(choice["token_ids"]),
                logprobs=token_logprobs,
                prompt_token_ids=list(data.get("prompt_token_ids") or []),
                finish_reason=choice.get("finish_reason"),
            )
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise UpstreamError(f"unexpected chat response shape from {model!r}: {exc!r}") from exc

    async def score_tokens(
        self, model: str, prompt_ids: list[int], target_ids: list[int]
    ) -> list[float]:
        """Logprob of each of `target_ids` after `prompt_ids` under `model`.

        One single-token request per position, forced with `allowed_token_ids`: vLLM reports
        the raw logprob (computed before the whitelist), and prefix caching makes the shared
        prefix cheap. `prompt_logprobs`/`echo` would do it in one request, but with LoRA
        enabled they crash vLLM's engine when a LoRA request shares the batch (vLLM issues
        #16668, #29955), which would take down the serving replica.
        """
        return list(
            await asyncio.gather(
                *[
                    self._forced_logprob(model, [*prompt_ids, *target_ids[:k]], target)
                    for k, target in enumerate(target_ids)
                ]
            )
        )

    async def _forced_logprob(self, model: str, prefix: list[int], target: int) -> float:
        data = await self.post(
            "/v1/completions",
            {
                "model": model,
                "prompt": prefix,
                "max_tokens": 1,
                "temperature": 0.0,
                "logprobs": 0,
                "allowed_token_ids": [target],
                "return_token_ids": True,
            },
        )
        try:
            choice = data["choices"][0]
            produced = choice.get("token_ids") or []
            if produced[:1] != [target]:
                raise UpstreamError(f"forced token {target} but {model!r} produced {produced}")
            return float(choice["logprobs"]["token_logprobs"][0])
        except (KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"unexpected completion logprobs from {model!r}: {exc!r}") from exc

    async def list_models(self) -> list[str]:
        try:
            async with self.session.get(f"{self.base_url}/v1/models") as response:
                response.raise_for_status()
                data = await response.json()
        except aiohttp.ClientResponseError as exc:
            error = UpstreamUnavailable if exc.status >= 500 else UpstreamError
            raise error(f"GET /v1/models failed: {exc}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"GET /v1/models failed: {exc}") from exc
        return [model["id"] for model in data.get("data", [])]
