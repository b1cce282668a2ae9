"""Minimal async client for the parts of vLLM's OpenAI-compatible API the gates need:
greedy/seeded chat sampling with token ids and logprobs, and scoring fixed token ids (so KL
is computed on the exact sampled ids, never on re-tokenised text)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from safety.gates.aio import gather_or_cancel
from safety.gates.types import GateError

# How long an idle connection to vLLM is reused: below vLLM's own keep-alive (5 s,
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so that a request never goes out on a connection vLLM is
# closing. The learner's replica client uses it too.
VLLM_SAFE_KEEPALIVE_S = 4.0

# Where vLLM puts what a model says while it reasons (`--reasoning-parser`): older releases
# `reasoning_content`, newer ones `reasoning`.
REASONING_FIELDS = ("reasoning_content", "reasoning")


class UpstreamError(GateError):
    """The model server refused or failed a request."""


# What aiohttp raises for a URL it cannot send a request to (a missing or unknown scheme, no
# host), before anything goes out.
_BAD_URL = (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)


class UpstreamUnavailable(UpstreamError):
    """The model server did not answer (connection refused or dropped, a timeout, a 5xx):
    nothing about the models was measured. The suite marks the gates it failed
    `unreachable`, and a report failed by nothing else is no verdict on the candidate (the
    promoter defers it, as it does an outage while loading it)."""


def said(message: dict[str, Any]) -> str | None:
    """What a chat reply says: `content`, or, when that is empty or blank, the first
    reasoning field holding text; None when no field holds any.

    With vLLM's `--reasoning-parser` a model that thinks first keeps `content` null past the
    gates' 16 tokens, and its words go to `reasoning_content` / `reasoning`. Only `content`
    was read, so every model answered "" and a candidate wrong on every regression probe and
    compliant with every red-team prompt passed every gate: the gates judge what the model
    said, wherever the server put it."""
    fields = [message.get("content"), *(message.get(key) for key in REASONING_FIELDS)]
    texts = [value for value in fields if isinstance(value, str) and value]
    return next((text for text in texts if text.strip()), texts[0] if texts else None)


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
        self._closed = False

    async def __aenter__(self) -> VllmClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            # The session used to be opened again on demand: a request still running after
            # its suite closed the client opened one that nobody would close, and went on
            # asking the model server after the report was written.
            raise GateError(
                f"the gate client for {self.base_url} is closed: no request may open a new "
                "session after aclose()"
            )
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
            except _BAD_URL as exc:
                # A URL aiohttp cannot send to (`guard-host:8000`, no scheme) is a setting to
                # fix, not an outage: read as one, every candidate was deferred, gate run
                # after gate run, until `max_unanswered_gates` rejected it.
                raise UpstreamError(
                    f"POST {path} model={body.get('model')!r}: the URL {url!r} is not an "
                    f"http(s) URL ({type(exc).__name__})"
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
            token_ids = list(choice["token_ids"])
            text = said(choice["message"])
            if text is None and len(token_ids) > 1:
                # Tokens but no text in any field we read: what the model said went
                # somewhere else (a reasoning field of another name), and judging "" for
                # every model would make the gates compare nothing with nothing. One token
                # and no text is a reply that stopped at once (the end-of-text token).
                raise UpstreamError(
                    f"{model!r} produced {len(token_ids)} tokens but no text in content or "
                    f"{' / '.join(REASONING_FIELDS)} (message keys: "
                    f"{sorted(choice['message'])})"
                )
            token_logprobs = None
            if logprobs:
                token_logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
            return Completion(
                text=text or "",
                token_ids=token_ids,
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
        return await gather_or_cancel(
            *[
                self._forced_logprob(model, [*prompt_ids, *target_ids[:k]], target)
                for k, target in enumerate(target_ids)
            ]
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
        except _BAD_URL as exc:
            raise UpstreamError(
                f"GET /v1/models: {self.base_url!r} is not an http(s) URL ({type(exc).__name__})"
            ) from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"GET /v1/models failed: {exc}") from exc
        return [model["id"] for model in data.get("data", [])]
