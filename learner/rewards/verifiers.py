"""Built-in verifiers and the loader that runs pluggable ones with a timeout.

A verifier is any callable `fn(trajectory: dict, choice: dict, **params) -> float | None`
(None: not applicable to this sample). Config selects them by import path `module:function`.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jsonschema

# The `regex` engine (a dependency of transformers, pinned in the constraints files) stops a
# match at a timeout; `re` holds the interpreter lock for a whole catastrophic backtrack, so
# no thread ran, the verifier's timeout never fired, and the learner froze (27 s for a
# 29-character reply to `^(\w+\s?)*$`, hours for a few more).
import regex
import structlog

from learner.config import VerifierSpec

log = structlog.get_logger(__name__)

Verifier = Callable[..., float | None]

_FAILED = object()  # `VerifierRunner._run`: the verifier failed (not: it abstained)
_MATCH_TIMEOUT_S = 2.0  # `regex_match`'s own bound, for a runner timeout set higher
# Timed-out calls of one verifier still running, past which it is not called again until
# some end: a verifier that hangs (a server that never answers) left a thread per sample,
# until no thread could start and the learner died.
_MAX_STUCK_PER_VERIFIER = 32


class VerifierScore(NamedTuple):
    """The verifiers' weighted mean for one sample (None: none gave a value), and whether
    one of them failed on it."""

    value: float | None
    failed: bool


_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)
_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?\d+(?:[.,]\d+)*")  # `42.5` and `1,000` are one number each


def choice_text(choice: dict[str, Any]) -> str:
    """The sampled text of one choice (chat message content or completions text)."""
    message = choice.get("message")
    if isinstance(message, dict):
        return message.get("content") or ""
    return choice.get("text") or ""


def tool_calls_text(calls: Any) -> str:
    """Tool calls as a grader reads them, one a line: `[tool call] name({"arg": ...})`."""
    lines = []
    for call in calls if isinstance(calls, list) else []:
        function = (call or {}).get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            name, arguments = function.get("name"), function.get("arguments")
            lines.append(f"[tool call] {name}({arguments if arguments is not None else ''})")
    return "\n".join(lines)


def reply_text(choice: dict[str, Any]) -> str:
    """What one choice said, its tool calls included: `choice_text` alone is empty for a
    reply that only calls tools (`content: null`), and a judge shown that graded the right
    call and a destructive one alike, and every text answer above both."""
    message = choice.get("message")
    calls = tool_calls_text(message.get("tool_calls")) if isinstance(message, dict) else ""
    text = choice_text(choice)
    return f"{text}\n{calls}" if text and calls else text or calls


def only_tool_calls(choice: dict[str, Any]) -> bool:
    """Whether the reply is tool calls and no text: nothing a text check can judge."""
    message = choice.get("message")
    return (
        isinstance(message, dict)
        and bool(message.get("tool_calls"))
        and not choice_text(choice).strip()
    )


def message_text(content: Any) -> str | None:
    """A request message's text: its content, or its parts joined (vLLM takes plain-string
    parts as well as {"type": "text", "text": ...}); None for anything else."""
    if isinstance(content, list):
        return " ".join(
            part if isinstance(part, str) else str(part.get("text", ""))
            for part in content
            if isinstance(part, str | dict)
        )
    return content if isinstance(content, str) else None


def _lookup(record: dict[str, Any], dotted: str) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _expected(trajectory: dict[str, Any], params: dict[str, Any]) -> str | None:
    if "expected" in params:
        return str(params["expected"])
    path = params.get("expected_path")
    if path:
        value = _lookup(trajectory, path)
        return None if value is None else str(value)
    return None


def exact_match(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float | None:
    """1.0 when the reply equals the expected answer (`expected` or `expected_path`), else 0.0;
    None for a reply of tool calls only (a text check has nothing to judge there: 0 scored
    every tool-calling agent turn as a wrong answer)."""
    expected = _expected(trajectory, params)
    if expected is None or only_tool_calls(choice):
        return None
    text = choice_text(choice)
    if params.get("strip", True):
        text, expected = text.strip(), expected.strip()
    if not params.get("case_sensitive", True):
        text, expected = text.lower(), expected.lower()
    return 1.0 if text == expected else 0.0


def regex_match(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float | None:
    """1.0 when `pattern` matches the reply (`fullmatch: true` for the whole reply); None for
    a reply of tool calls only."""
    pattern = params.get("pattern")
    if not pattern:
        raise ValueError("regex_match needs params.pattern")
    if only_tool_calls(choice):
        return None
    text = choice_text(choice).strip()
    matcher = regex.fullmatch if params.get("fullmatch", False) else regex.search
    # A match past the timeout raises TimeoutError: a failed verifier call (logged,
    # counted), not a 0.0 scored as the answer's. `concurrent` lets the runner's own
    # timeout fire meanwhile when it is the shorter one.
    found = matcher(pattern, text, regex.DOTALL, timeout=_MATCH_TIMEOUT_S, concurrent=True)
    return 1.0 if found else 0.0


def _not_json(constant: str) -> Any:
    """`json.loads`' hook for NaN and Infinity, which Python reads and JSON does not have:
    output that strict clients refuse was rewarded as valid."""
    raise ValueError(f"{constant} is not JSON")


def json_valid(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float | None:
    """1.0 when the reply is JSON (optionally inside a ``` fence) valid against `schema`;
    None for a reply of tool calls only."""
    if only_tool_calls(choice):
        return None
    text = choice_text(choice).strip()
    fenced = _FENCE.match(text)
    if fenced and params.get("allow_fence", False):
        text = fenced.group(1).strip()
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return 0.0
    schema = params.get("schema")
    if schema is not None:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError:
            return 0.0
    return 1.0


def tool_calls_valid(
    trajectory: dict[str, Any], choice: dict[str, Any], **params: Any
) -> float | None:
    """1.0 when every tool call parses as a JSON object and names a declared tool.

    None when the sample made no tool call (nothing to verify).
    """
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    if not calls:
        return None
    tools = (trajectory.get("request") or {}).get("tools") or []
    declared = {
        (tool.get("function") or {}).get("name") for tool in tools if isinstance(tool, dict)
    }
    for call in calls:
        function = (call or {}).get("function") or {}
        if function.get("name") not in declared:
            return 0.0
        try:
            arguments = json.loads(function.get("arguments") or "", parse_constant=_not_json)
        except ValueError:
            return 0.0
        if not isinstance(arguments, dict):
            return 0.0
    return 1.0


def number_answer(
    trajectory: dict[str, Any], choice: dict[str, Any], **params: Any
) -> float | None:
    """Shaped reward for "reply with only the number" tasks.

    0 unless the sample stopped by itself (a run of digits to the token limit is a hack);
    then a bare integer scores 0.8, a reply starting with an integer 0.3, other 0; plus a
    brevity term up to 0.2 and, when the expected answer is known, `correct_bonus` if right:
    the reply's only number is the expected integer (its leading integer was compared, so
    `42.5` and `42 or maybe 17` got the bonus of `42`, a hedge the policy could learn).
    """
    if choice.get("finish_reason") != "stop":
        return 0.0
    text = choice_text(choice).strip()
    brevity_tokens = float(params.get("brevity_tokens", 16))
    n_tokens = len(choice.get("token_ids") or []) or len(text.split())
    brevity = 0.2 * max(0.0, 1.0 - n_tokens / brevity_tokens)
    if _INTEGER.fullmatch(text):
        form = 0.8
    elif _INTEGER.match(text):
        form = 0.3
    else:
        return brevity * 0.5
    reward = form + brevity
    expected = _expected(trajectory, params)
    numbers = _NUMBER.findall(text)
    if expected is not None and len(numbers) == 1 and numbers[0].lstrip("+") == expected.strip():
        reward += float(params.get("correct_bonus", 0.0))
    return reward


# The params each built-in reads, checked when the learner starts: a regex_match without a
# pattern (or with one that does not compile) was accepted and then failed on every sample,
# and a misspelt key (`expected_pth`) made a verifier return "not applicable" for ever.
def _needs_expected(params: dict[str, Any]) -> None:
    if "expected" not in params and not params.get("expected_path"):
        raise ValueError("needs params.expected or params.expected_path")


def _compiles(params: dict[str, Any]) -> None:
    pattern = params.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("needs params.pattern, a regular expression")
    try:
        regex.compile(pattern, regex.DOTALL)  # the engine `regex_match` runs it with
    except regex.error as exc:
        raise ValueError(f"params.pattern does not compile: {exc}") from exc


def _valid_schema(params: dict[str, Any]) -> None:
    schema = params.get("schema")
    if schema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"params.schema is not a JSON schema: {exc.message}") from exc


def _positive_brevity(params: dict[str, Any]) -> None:
    for name in ("brevity_tokens", "correct_bonus"):
        value = params.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"params.{name} must be a number")
    if not params.get("brevity_tokens", 16) > 0:
        raise ValueError("params.brevity_tokens must be above 0")


_BUILTIN_PARAMS: dict[Verifier, tuple[frozenset[str], Callable[[dict[str, Any]], None] | None]] = {
    exact_match: (
        frozenset({"expected", "expected_path", "strip", "case_sensitive"}),
        _needs_expected,
    ),
    regex_match: (frozenset({"pattern", "fullmatch"}), _compiles),
    json_valid: (frozenset({"allow_fence", "schema"}), _valid_schema),
    tool_calls_valid: (frozenset(), None),
    number_answer: (
        frozenset({"brevity_tokens", "expected", "expected_path", "correct_bonus"}),
        _positive_brevity,
    ),
}


def check_params(fn: Verifier, params: dict[str, Any]) -> None:
    """ValueError when a built-in verifier's params are not ones it reads (a plug-in's
    params are its own business)."""
    known = _BUILTIN_PARAMS.get(fn)
    if known is None:
        return
    names, check = known
    unknown = sorted(set(params) - names)
    if unknown:
        takes = ", ".join(sorted(names)) or "none"
        raise ValueError(f"unknown params {', '.join(unknown)} (it takes: {takes})")
    if check is not None:
        check(params)


def load_verifier(path: str) -> Verifier:
    """Import `module:function`; raises ValueError with the path on failure."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"verifier path {path!r} must look like 'package.module:function'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load verifier {path!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"verifier {path!r} is not callable")
    return target


class _Call:
    """One verifier call on its own daemon thread.

    A call that outlives its timeout cannot be killed, but it holds only its own thread:
    later calls never queue behind it (a pool's workers would, and a pool's threads are
    joined at interpreter exit, so a hung verifier would also block shutdown).
    """

    def __init__(self, fn: Verifier, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._done = threading.Event()
        self.value: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="olp-verifier", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.value = self._fn(*self._args, **self._kwargs)
        except BaseException as exc:  # handed to the caller, which logs and counts it
            # SystemExit (model-written code calling exit()) and CancelledError too: they
            # left neither value nor error, read as the verifier abstaining.
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class VerifierRunner:
    """Runs the configured verifiers on each sample, each under its own timeout.

    A verifier that raises, returns a non-finite value or times out gives no value for that
    sample (logged, counted in `errors` / `timeouts`), never an exception in the learner.
    """

    def __init__(self, specs: list[VerifierSpec]) -> None:
        self._verifiers: list[tuple[VerifierSpec, Verifier]] = []
        for index, spec in enumerate(specs):
            try:
                fn = load_verifier(spec.path)
            except ValueError as exc:  # name the config key, not only the import path
                raise ValueError(f"learner.rewards.verifiers[{index}].path: {exc}") from exc
            try:
                check_params(fn, spec.params)
            except ValueError as exc:
                raise ValueError(
                    f"learner.rewards.verifiers[{index}].params: {spec.path} {exc}"
                ) from exc
            self._verifiers.append((spec, fn))
        # Timed-out calls still running, by verifier path.
        self._stuck: dict[str, list[threading.Thread]] = {}
        self.timeouts = 0
        self.errors = 0

    def __bool__(self) -> bool:
        return bool(self._verifiers)

    @property
    def stuck(self) -> int:
        """Timed-out verifier calls whose thread is still running."""
        return sum(self._stuck_of(path) for path in list(self._stuck))

    def _stuck_of(self, path: str) -> int:
        alive = [t for t in self._stuck.get(path, []) if t.is_alive()]
        self._stuck[path] = alive
        return len(alive)

    def score(self, trajectory: dict[str, Any], choice: dict[str, Any]) -> float | None:
        """Weighted mean of the verifiers that returned a value, or None if none did."""
        return self.verify(trajectory, choice).value

    def verify(self, trajectory: dict[str, Any], choice: dict[str, Any]) -> VerifierScore:
        """`score`, and whether a verifier failed (timed out, raised, or returned a value
        that is not a finite number) on this sample: the mean then lacks a part its
        siblings' means hold, and the assembler does not compare them."""
        total = 0.0
        weight = 0.0
        failed = False
        task = trajectory.get("task")
        for spec, fn in self._verifiers:
            if spec.tasks is not None and task not in spec.tasks:
                continue
            value = self._run(spec, fn, trajectory, choice)
            if value is _FAILED:
                failed = True
            elif isinstance(value, float):
                total += spec.weight * value
                weight += spec.weight
        return VerifierScore(None if weight == 0 else total / weight, failed)

    def _run(
        self, spec: VerifierSpec, fn: Verifier, trajectory: dict[str, Any], choice: dict[str, Any]
    ) -> float | object | None:
        """The verifier's value, None when it abstains, `_FAILED` when it failed."""
        if self._stuck_of(spec.path) >= _MAX_STUCK_PER_VERIFIER:
            self.errors += 1
            log.warning(
                "verifier_skipped",
                verifier=spec.path,
                reason=f"{_MAX_STUCK_PER_VERIFIER} of its calls are still running past "
                "their timeout",
            )
            return _FAILED
        try:
            call = _Call(fn, (trajectory, choice), spec.params)
        except RuntimeError as exc:  # no thread could start: a failed call, not a crash
            self.errors += 1
            log.warning("verifier_error", verifier=spec.path, error=repr(exc))
            return _FAILED
        if not call.wait(spec.timeout_s):
            self.timeouts += 1
            self._stuck.setdefault(spec.path, []).append(call.thread)
            log.warning(
                "verifier_timeout", verifier=spec.path, timeout_s=spec.timeout_s, stuck=self.stuck
            )
            return _FAILED
        if call.error is not None:
            self.errors += 1
            log.warning("verifier_error", verifier=spec.path, error=repr(call.error))
            return _FAILED
        if call.value is None:
            return None
        try:
            value = float(call.value)
        except (TypeError, ValueError, OverflowError) as exc:
            self.errors += 1
            log.warning("verifier_error", verifier=spec.path, error=repr(exc))
            return _FAILED
        if not math.isfinite(value):
            self.errors += 1
            log.warning("verifier_error", verifier=spec.path, error=f"non-finite value {value}")
            return _FAILED
        return value

    def close(self) -> None:
        """Nothing to release: calls run on daemon threads (kept for the callers' symmetry)."""
