"""Field type checks of completion requests: each checked field, a good and a bad value.
The real-stack errors test (test_proxy_errors.py) sends such bodies through the proxy."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import ProxyError
from proxy.validation import choice_count, validate_completion_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETIONS = {"model": "m", "prompt": "hi"}

# (endpoint, field, a value that passes, a value that does not)
CASES: list[tuple[str, str, Any, Any]] = [
    ("chat.completions", "logprobs", True, 1),
    ("chat.completions", "top_logprobs", 2, "2"),
    ("chat.completions", "tools", [], {}),
    ("chat.completions", "tool_choice", "auto", 1),
    ("chat.completions", "tool_choice", {"type": "function"}, ["auto"]),
    ("chat.completions", "max_completion_tokens", 5, 5.5),
    ("completions", "logprobs", 0, True),
    ("completions", "echo", False, "no"),
    ("chat.completions", "echo", False, "no"),
    ("chat.completions", "stream", True, "true"),
    ("chat.completions", "stream_options", {"include_usage": True}, []),
    ("chat.completions", "n", 2, 1.5),
    ("completions", "n", 1, True),
    ("chat.completions", "max_tokens", 16, "16"),
    ("chat.completions", "temperature", 0.5, True),
    ("completions", "top_p", 1, "1"),
    ("chat.completions", "seed", 7, 7.5),
    ("chat.completions", "user", "u-1", 1),
    ("chat.completions", "stop", ["\n", "END"], ["\n", 1]),
    ("completions", "stop", "END", 3),
    ("chat.completions", "return_token_ids", True, 1),
]


@pytest.mark.parametrize(("endpoint", "field", "good", "bad"), CASES)
def test_each_checked_field_accepts_its_type_and_names_a_wrong_one(
    endpoint: str, field: str, good: Any, bad: Any
) -> None:
    base = CHAT if endpoint == "chat.completions" else COMPLETIONS
    validate_completion_request(endpoint, {**base, field: good}, 100, 16)  # type: ignore[arg-type]
    validate_completion_request(endpoint, {**base, field: None}, 100, 16)  # type: ignore[arg-type]
    with pytest.raises(ProxyError) as caught:
        validate_completion_request(endpoint, {**base, field: bad}, 100, 16)  # type: ignore[arg-type]
    assert caught.value.status == 400
    assert caught.value.param == field
    assert caught.value.code == "invalid_type"
    assert type(bad).__name__ in caught.value.message


@pytest.mark.parametrize("key", ["include_usage", "continuous_usage_stats"])
def test_stream_options_flags_are_booleans(key: str) -> None:
    """`include_usage: "false"` was true to the proxy (it asked for no usage) and false to
    vLLM (it sent none): the captured record had no usage and could not train."""
    body = {**CHAT, "stream": True, "stream_options": {key: True}}
    validate_completion_request("chat.completions", body, 100, 16)
    with pytest.raises(ProxyError) as caught:
        bad = {**body, "stream_options": {key: "false"}}
        validate_completion_request("chat.completions", bad, 100, 16)
    assert (caught.value.status, caught.value.code) == (400, "invalid_type")
    assert caught.value.param == f"stream_options.{key}"


@pytest.mark.parametrize("n", [0, -3])
def test_a_choice_count_below_one_is_an_invalid_value_not_a_wrong_type(n: int) -> None:
    with pytest.raises(ProxyError) as caught:
        validate_completion_request("chat.completions", {**CHAT, "n": n}, 100, 16)
    assert (caught.value.status, caught.value.param) == (400, "n")
    assert caught.value.code == "invalid_value"
    assert caught.value.message == f"Invalid value for 'n': expected an integer >= 1, got {n}."


@pytest.mark.parametrize(
    ("endpoint", "field"),
    [
        ("chat.completions", "max_tokens"),
        ("chat.completions", "max_completion_tokens"),
        ("chat.completions", "n"),
        ("chat.completions", "seed"),
        ("chat.completions", "top_logprobs"),
        ("completions", "logprobs"),
    ],
)
def test_a_whole_float_passes_where_an_integer_is_expected(endpoint: str, field: str) -> None:
    """vLLM takes `max_tokens: 1024.0` (what a client computing its budget sends), so the
    proxy does too; a fraction is still refused."""
    base = CHAT if endpoint == "chat.completions" else COMPLETIONS
    assert_accepted(endpoint, {**base, field: 2.0})
    with pytest.raises(ProxyError) as caught:
        validate_completion_request(endpoint, {**base, field: 2.5}, 100, 16)  # type: ignore[arg-type]
    assert caught.value.code == "invalid_type"


def assert_accepted(endpoint: str, body: dict[str, Any], max_choices: int = 16) -> None:
    """Validation passes the body and leaves it as it came (it only ever refuses)."""
    before = dict(body)
    validate_completion_request(endpoint, body, 100, max_choices)  # type: ignore[arg-type]
    assert body == before


def test_unknown_fields_pass_through_unchecked() -> None:
    assert_accepted("chat.completions", {**CHAT, "x_vendor": object()})


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat.completions", {"prompt_logprobs": 0}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("completions", {"echo": True, "logprobs": 0}, "echo"),
        # vLLM asks chat's `top_logprobs` (default 0) prompt logprobs for every echo.
        ("chat.completions", {"echo": True}, "echo"),
        ("chat.completions", {"echo": True, "top_logprobs": None}, "echo"),
    ],
)
def test_what_makes_vllm_compute_prompt_logprobs_is_refused(
    endpoint: str, extra: dict[str, Any], param: str
) -> None:
    base = CHAT if endpoint == "chat.completions" else COMPLETIONS
    with pytest.raises(ProxyError) as caught:
        validate_completion_request(endpoint, {**base, **extra}, 100, 16)  # type: ignore[arg-type]
    assert caught.value.status == 400
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", param)


def test_echo_without_prompt_logprobs_passes() -> None:
    assert_accepted("completions", {**COMPLETIONS, "echo": True})
    assert_accepted("completions", {**COMPLETIONS, "echo": True, "logprobs": None})
    assert_accepted("chat.completions", {**CHAT, "echo": False})


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat.completions", {"n": 5}, "n"),
        ("completions", {"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
        ("completions", {"prompt": [[1, 2], [3], [4], [5], [6]]}, "prompt"),
        ("completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt"),
        # Times two, over the 4300 digits Python writes an int with: was a 500.
        ("completions", {"prompt": ["a", "b"], "n": int("9" * 4300)}, "prompt"),
        ("chat.completions", {"n": 5.0}, "n"),
    ],
)
def test_choices_over_the_limit_are_refused(
    endpoint: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(ProxyError) as caught:
        _validate_with_four_choices(endpoint, extra)
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        400,
        "too_many_choices",
        param,
    )
    assert "limit is 4" in caught.value.message


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [
        ("chat.completions", {"n": 4}),
        ("completions", {"prompt": list(range(50))}),  # one tokenized prompt, not a batch
        ("completions", {"prompt": ["a", "b"], "n": 2}),
        ("completions", {"prompt": [[1, 2], [3, 4, 5, 6]]}),
    ],
)
def test_choices_at_the_limit_pass(endpoint: str, extra: dict[str, Any]) -> None:
    base = CHAT if endpoint == "chat.completions" else COMPLETIONS
    assert_accepted(endpoint, {**base, **extra}, max_choices=4)


def _validate_with_four_choices(endpoint: str, extra: dict[str, Any]) -> None:
    base = CHAT if endpoint == "chat.completions" else COMPLETIONS
    validate_completion_request(endpoint, {**base, **extra}, 100, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "body", "choices"),
    [
        ("chat.completions", {"messages": []}, 1),
        ("chat.completions", {"n": 2.0}, 2),
        ("chat.completions", {"n": 3, "prompt": ["a", "b"]}, 3),  # a stray field: no batch
        ("completions", {"prompt": "a", "n": 2}, 2),
        ("completions", {"prompt": [1, 2, 3], "n": 2}, 2),  # token ids: one prompt
        ("completions", {"prompt": [[1], [2], [3]]}, 3),
        ("completions", {"prompt": ["a", "b"], "n": 2.0}, 4),
        ("completions", {"prompt": ["a", "b"], "n": None}, 2),
    ],
)
def test_choice_count_is_what_the_answer_holds(
    endpoint: str, body: dict[str, Any], choices: int
) -> None:
    assert choice_count(endpoint, body) == choices  # type: ignore[arg-type]
