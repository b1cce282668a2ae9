"""The finish chunks' `system_fingerprint`, carried from the usage chunk the proxy drops."""

from __future__ import annotations

from proxy.fingerprint import FingerprintCarry

CONTENT = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
)
FINISH = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
STAMPED = (
    b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"system_fingerprint":"vllm-0.32.0-abc"}\n\n'
)
USAGE = (
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3},'
    b'"system_fingerprint":"vllm-0.32.0-abc"}\n\n'
)
DONE = b"data: [DONE]\n\n"


def test_a_finish_chunk_waits_for_the_next_read_and_takes_its_fingerprint():
    carry = FingerprintCarry()
    assert carry.pass_on(CONTENT, CONTENT) == CONTENT
    assert carry.pass_on(CONTENT + FINISH, CONTENT + FINISH) == CONTENT  # finish held
    assert carry.pass_on(USAGE, b"") == STAMPED  # the usage chunk itself was dropped
    assert carry.pass_on(DONE, DONE) == DONE
    assert carry.flush() == b""


def test_finish_and_usage_in_one_read_go_out_at_once():
    carry = FingerprintCarry()
    block = FINISH + USAGE + DONE
    assert carry.pass_on(block, FINISH + DONE) == STAMPED + DONE
    assert carry.flush() == b""


def test_a_next_read_without_usage_releases_the_held_finish_unstamped():
    """n = 2: the first choice finished; the second goes on. Its finish goes out with the
    next read rather than wait for the whole generation."""
    carry = FingerprintCarry()
    assert carry.pass_on(FINISH, FINISH) == b""
    assert carry.pass_on(CONTENT, CONTENT) == FINISH + CONTENT
    assert carry.pass_on(FINISH, FINISH) == b""
    assert carry.pass_on(USAGE + DONE, DONE) == STAMPED + DONE


def test_choices_finishing_in_consecutive_reads_wait_together():
    carry = FingerprintCarry()
    assert carry.pass_on(CONTENT + FINISH, CONTENT + FINISH) == CONTENT
    assert carry.pass_on(FINISH, FINISH) == b""
    assert carry.pass_on(USAGE + DONE, DONE) == STAMPED + STAMPED + DONE


def test_the_held_finish_goes_out_when_the_stream_ends_without_another_read():
    carry = FingerprintCarry()
    assert carry.pass_on(FINISH, FINISH) == b""
    assert carry.flush() == FINISH
    assert carry.flush() == b""


def test_a_finish_read_ending_the_stream_is_not_held():
    carry = FingerprintCarry()
    assert carry.pass_on(FINISH + DONE, FINISH + DONE) == FINISH + DONE


def test_text_that_reads_like_the_keys_is_left_alone():
    """Inside a JSON string a `"` is escaped: a content delta quoting the keys is no key."""
    quoting = (
        b'data: {"choices":[{"delta":{"content":"\\"finish_reason\\":\\"x\\" '
        b'\\"system_fingerprint\\":\\"y\\""},"finish_reason":null}]}\n\n'
    )
    carry = FingerprintCarry()
    assert carry.pass_on(quoting, quoting) == quoting
    assert carry.pass_on(quoting + FINISH, quoting + FINISH) == quoting
    assert carry.pass_on(quoting + USAGE, quoting) == STAMPED + quoting
