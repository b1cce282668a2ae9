"""Minimal async client for the parts of vLLM's OpenAI-compatible API the gates need:
greedy/seeded chat sampling with token ids and logprobs, and scoring fixed token ids with
`prompt_logprobs` (so KL is computed on the exact sampled ids, never re-tokenised text)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from safety.gates.types import GateError


class UpstreamError(GateError):
    """The model server refused or failed a request."""


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

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        url = f"{self.base_url}{path}"
        async with self._limit:
            try:
                async with self._session.post(url, json=body) as response:
                    text = await response.text()
                    if response.status != 200:
                        raise UpstreamError(
                            f"POST {path} model={body.get('model')!r} -> HTTP {response.status}: "
                            f"{text[:300]}"
                        )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise UpstreamError(
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
    ) -> Completion:
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if logprobs:
            body["logprobs"] = True
        data = await self.post("/v1/chat/completions", body)
        try:
            choice = data["choices"][0]
            token_logprobs = None
            if logprobs:
                token_logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
            return Completion(
                text=choice["message"].get("content") or "",
                token_ids=list(choice.get("token_ids") or []),
                logprobs=token_logprobs,
                prompt_token_ids=list(data.get("prompt_token_ids") or []),
                finish_reason=choice.get("finish_reason"),
            )
        except (KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(f"unexpected chat response shape from {model!r}: {exc!r}") from exc

    async def score_tokens(
        self, model: str, prompt_ids: list[int], target_ids: list[int]
    ) -> list[float]:
        """Logprob of each of `target_ids` after `prompt_ids` under `model` (one prefill)."""
        if not target_ids:
            return []
        ids = [*prompt_ids, *target_ids]
        data = await self.post(
            "/v1/completions",
            {
                "model": model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            },
        )
        try:
            positions = data["choices"][0]["prompt_logprobs"]
            scored = positions[len(prompt_ids) :]
            if len(scored) != len(target_ids):
                raise UpstreamError(
                    f"prompt_logprobs covers {len(positions)} positions, expected {len(ids)}"
                )
            return [
                float(entry[str(tid)]["logprob"])
                for entry, tid in zip(scored, target_ids, strict=True)
            ]
        except (KeyError, IndexError, TypeError) as exc:
            raise UpstreamError(
                f"unexpected prompt_logprobs shape from {model!r}: {exc!r}"
            ) from exc

    async def list_models(self) -> list[str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
        try:
            async with self._session.get(f"{self.base_url}/v1/models") as response:
                response.raise_for_status()
                data = await response.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(f"GET /v1/models failed: {exc}") from exc
        return [model["id"] for model in data.get("data", [])]
