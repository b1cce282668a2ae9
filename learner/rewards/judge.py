"""Generative reward model: an LLM judge behind any OpenAI-compatible endpoint.

The judge grades one reply against a rubric with a single digit 0-9 and, when several
replies share a group, names the best one with a letter. Both answers are read from the
top logprobs of a single generated token (expected digit / letter probabilities), so even
a small judge model gives a parseable score; the reply text is the fallback. Calls have a
timeout and retries; verdicts are cached by content; the raw verdict is kept for audit.
A judge that fails or times out yields no score (None), never an exception.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import structlog

from learner.config import JudgeConfig
from learner.rewards.verifiers import message_text, reply_text, tool_calls_text
from safety.gates.client import VLLM_SAFE_KEEPALIVE_S

log = structlog.get_logger(__name__)

_LETTERS = "ABCDEFGH"
_TOOL_DESCRIPTION_CHARS = 200  # of each declared tool's description the judge is shown
STOPPED = "stopped"  # the error of a verdict not asked for because the learner is stopping
_DIGIT = re.compile(r"\d")


@dataclass
class JudgeVerdict:
    """A judge's answer: score in [0, 1] or None, and the raw material it came from."""

    score: float | None
    raw: dict[str, Any] = field(default_factory=dict)
    cached: bool = False
    error: str | None = None


def prompt_text(trajectory: dict[str, Any], max_chars: int) -> str:
    """The conversation as the judge sees it (role-tagged, truncated from the front): the
    tools the client declared, then each message with its tool calls."""
    request = trajectory.get("request") or {}
    if "messages" in request:
        lines = [_tool_line(tool) for tool in request.get("tools") or []]
        for message in request["messages"]:
            content = message.get("content")
            text = message_text(content) if isinstance(content, list) else content
            calls = tool_calls_text(message.get("tool_calls"))
            said = "\n".join(part for part in (text, calls) if part)
            lines.append(f"{message.get('role', 'user')}: {said}")
        text = "\n".join(line for line in lines if line is not None)
    else:
        text = str(request.get("prompt", ""))
    return text[-max_chars:]


def _tool_line(tool: Any) -> str | None:
    """A declared tool, for the judge: `tool name: description`."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not function.get("name"):
        return None
    description = str(function.get("description") or "")[:_TOOL_DESCRIPTION_CHARS]
    return f"tool {function['name']}: {description}" if description else f"tool {function['name']}"


def _top_logprobs(response: Any) -> list[tuple[str, float]]:
    choice = response.choices[0]
    content = getattr(choice.logprobs, "content", None) if choice.logprobs else None
    if not content:
        return []
    return [(entry.token, entry.logprob) for entry in content[0].top_logprobs or []]


def _distribution(tops: list[tuple[str, float]], labels: str) -> dict[str, float]:
    """Normalised probability of each label among the top tokens (labels absent: 0)."""
    probs: dict[str, float] = {}
    for token, logprob in tops:
        label = token.strip()
        # Above 0 a logprob is at most rounding (1e-7 from some servers): counted as 0, not
        # dropped (which handed the label's mass to the others). math.exp of one above ~709
        # raised OverflowError, which stopped the learner on the batch at every retry.
        if len(label) == 1 and label in labels and not math.isnan(logprob):
            probs[label] = probs.get(label, 0.0) + math.exp(min(logprob, 0.0))
    total = sum(probs.values())
    return {label: p / total for label, p in probs.items()} if total > 0 else {}


class Judge:
    """Rubric scoring and group ranking through an OpenAI-compatible chat endpoint."""

    def __init__(
        self,
        config: JudgeConfig,
        base_url: str | None = None,
        api_key: str | None = None,
        base_name: str = "base",
    ) -> None:
        """`base_url` / `api_key`: the policy's vLLM and its key, used when the config names
        no judge URL of its own (`learner.rewards.judge.api_key` goes with its `base_url`).
        There `model: base` means the base model under the name that vLLM serves it as
        (`base_name`, `policy.served_model_name`): with another served name, every judge
        call was a 404, counted as `judge_failed` and rewarding nothing."""
        url = config.base_url or base_url
        if not url:
            raise ValueError("judge needs learner.rewards.judge.base_url (or the policy URL)")
        own_key = config.api_key.get_secret_value()
        key = own_key if config.base_url or not api_key else api_key
        if not config.base_url and config.model == "base" and base_name != "base":
            config = config.model_copy(update={"model": base_name})
        self.config = config
        # openai keeps idle connections 5 s, as long as vLLM does: one reused at that age
        # could be closing. Dropped after 4 s (any judge server takes that).
        limits = httpx.Limits(
            max_connections=1000,
            max_keepalive_connections=100,
            keepalive_expiry=VLLM_SAFE_KEEPALIVE_S,
        )
        self._client = openai.OpenAI(
            base_url=url,
            api_key=key,
            timeout=config.timeout_s,
            max_retries=0,
            http_client=openai.DefaultHttpxClient(limits=limits),
        )
        self._cache: OrderedDict[str, JudgeVerdict] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix="olp-judge"
        )
        self._closed = False
        self.failures = 0
        self.calls = 0

    # -- public -----------------------------------------------------------------------------
    def score(
        self,
        trajectory: dict[str, Any],
        choice: dict[str, Any],
        stop: threading.Event | None = None,
    ) -> JudgeVerdict:
        """Absolute rubric score of one reply in [0, 1] (None on failure, or once `stop`
        is set)."""
        prompt = prompt_text(trajectory, self.config.max_chars)
        reply = reply_text(choice)[: self.config.max_chars]
        user = (
            f"Rubric: {self.config.rubric}\n\nConversation:\n{prompt}\n\n"
            f"Reply to grade:\n{reply}\n\n"
            "Grade the reply against the rubric from 0 (bad) to 9 (excellent). "
            "Answer with a single digit."
        )
        return self._ask("score", user, "0123456789", self._digit_score, stop)

    def rank(
        self,
        trajectory: dict[str, Any],
        choices: list[dict[str, Any]],
        stop: threading.Event | None = None,
    ) -> JudgeVerdict:
        """Relative preference of several replies to one prompt: raw['preference'][i] in [0,1]."""
        if not 2 <= len(choices) <= len(_LETTERS):
            return JudgeVerdict(score=None, error=f"cannot rank {len(choices)} replies")
        prompt = prompt_text(trajectory, self.config.max_chars)
        per_reply = max(50, self.config.max_chars // len(choices))
        listed = "\n\n".join(
            f"Reply {_LETTERS[i]}:\n{reply_text(c)[:per_reply]}" for i, c in enumerate(choices)
        )
        labels = _LETTERS[: len(choices)]
        user = (
            f"Rubric: {self.config.rubric}\n\nConversation:\n{prompt}\n\n{listed}\n\n"
            f"Which reply fits the rubric best? Answer with a single letter ({', '.join(labels)})."
        )
        return self._ask("rank", user, labels, self._letter_preference, stop)

    def score_group(
        self,
        trajectory: dict[str, Any],
        choices: list[dict[str, Any]],
        stop: threading.Event | None = None,
        rank: bool = True,
    ) -> list[JudgeVerdict]:
        """Score each reply; with several replies, rank_groups and `rank`, mix in their
        ranking. Once `stop` is set no further call starts (calls in flight end within
        timeout_s).

        A reply whose own score failed keeps its failed verdict (no score, its error), the
        ranking only beside it in `raw`: scored from the ranking alone it stood on another
        scale than its siblings' half-and-half mix, above a sibling the judge preferred,
        and its failure was neither marked `incomplete` nor counted as `judge_failed`."""
        verdicts = list(self._pool.map(lambda c: self.score(trajectory, c, stop), choices))
        if not (rank and self.config.rank_groups and 2 <= len(choices) <= len(_LETTERS)):
            return verdicts
        ranking = self.rank(trajectory, choices, stop)
        preference = ranking.raw.get("preference") if ranking.score is not None else None
        if not preference:
            return verdicts
        top = max(preference) or 1.0
        mixed = []
        for verdict, pref in zip(verdicts, preference, strict=True):
            raw = {"score": verdict.raw, "rank": ranking.raw}
            if verdict.score is None:
                error = verdict.error or "no score"
                mixed.append(JudgeVerdict(score=None, raw=raw, cached=verdict.cached, error=error))
                continue
            score = 0.5 * verdict.score + 0.5 * pref / top
            mixed.append(JudgeVerdict(score=score, raw=raw, cached=verdict.cached))
        return mixed

    def close(self) -> None:
        """Stop the worker threads and close the HTTP client's connections (else both live
        as long as the process). Calls queued and not started are cancelled; a call in
        flight ends within its timeout. Idempotent; the judge cannot score afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pool.shutdown(wait=False, cancel_futures=True)
        finally:
            self._client.close()

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _digit_score(tops: list[tuple[str, float]], text: str, labels: str) -> dict[str, Any]:
        dist = _distribution(tops, labels)
        if dist:
            expected = sum(int(d) * p for d, p in dist.items())
            return {"score": expected / 9.0, "distribution": dist}
        digit = _DIGIT.search(text)
        if digit:
            return {"score": int(digit.group(0)) / 9.0, "distribution": {}}
        return {"score": None, "distribution": {}}

    @staticmethod
    def _letter_preference(tops: list[tuple[str, float]], text: str, labels: str) -> dict[str, Any]:
        dist = _distribution(tops, labels)
        first = text.strip()[:1]
        # `first` may be "" (a whitespace answer): `"" in labels` is true, and indexing it
        # raised, which made an ordinary unparseable verdict a retried, uncached failure.
        if not dist and first and first in labels:
            dist = {first: 1.0}
        if not dist:
            return {"score": None, "preference": None}
        preference = [dist.get(label, 0.0) for label in labels]
        return {"score": max(preference), "preference": preference}

    def _ask(
        self, kind: str, user: str, labels: str, parse: Any, stop: threading.Event | None
    ) -> JudgeVerdict:
        # A client's lone surrogate (`"\ud800"` in its JSON) reaches the record as it came
        # (docs/stream.md), and UTF-8 cannot carry it: the openai client raised
        # UnicodeEncodeError out of the learner's step, on the same batch at every restart.
        # The judge reads the escape the client wrote.
        user = user.encode("utf-8", "backslashreplace").decode("utf-8")
        key = hashlib.sha256(
            json.dumps([kind, self.config.model, self.config.rubric, user]).encode()
        ).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                # An unparseable verdict is cached too (at temperature 0 the judge would
                # answer alike), and it stays a failed one, with its error.
                return JudgeVerdict(score=hit.score, raw=hit.raw, cached=True, error=hit.error)
        error = None
        for attempt in range(self.config.retries + 1):
            if stop is not None and stop.is_set():
                # Not the judge's failure: the learner is stopping and drops this batch.
                return JudgeVerdict(score=None, raw={}, error=STOPPED)
            self.calls += 1
            try:
                response = self._client.chat.completions.create(
                    model=self.config.model,
                    messages=[
                        {"role": "system", "content": "You are a strict, fair grader."},
                        {"role": "user", "content": user},
                    ],
                    max_tokens=1,
                    temperature=0.0,
                    logprobs=True,
                    top_logprobs=20,
                )
            except (openai.APITimeoutError, openai.APIConnectionError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.warning("judge_call_failed", kind=kind, attempt=attempt, error=error)
                continue
            except openai.APIStatusError as exc:
                error = f"HTTP {exc.status_code}"
                log.warning("judge_call_failed", kind=kind, attempt=attempt, error=error)
                if exc.status_code < 500 and exc.status_code != 429:
                    break
                continue
            except openai.APIError as exc:  # e.g. a 200 whose body is no JSON
                error = f"{type(exc).__name__}: {exc}"
                log.warning("judge_call_failed", kind=kind, attempt=attempt, error=error)
                continue
            try:
                # A 200 of another shape (no choices, an HTML page, an error object) must be
                # a failed verdict: raised, it stopped the learner on the batch, every retry.
                text = response.choices[0].message.content or ""
                tops = _top_logprobs(response)
                parsed = parse(tops, text, labels)
            except (
                AttributeError,
                IndexError,
                KeyError,
                TypeError,
                ValueError,
                ArithmeticError,
            ) as exc:
                error = f"malformed judge reply: {type(exc).__name__}: {exc}"
                log.warning("judge_call_failed", kind=kind, attempt=attempt, error=error)
                continue
            raw = {"text": text, "top_logprobs": tops, **parsed}
            verdict = JudgeVerdict(score=parsed["score"], raw=raw)
            if verdict.score is None:
                verdict.error = "unparseable verdict"
            if self.config.cache_size > 0:
                with self._lock:
                    self._cache[key] = verdict
                    while len(self._cache) > self.config.cache_size:
                        self._cache.popitem(last=False)
            return verdict
        self.failures += 1
        return JudgeVerdict(score=None, raw={}, error=error)
