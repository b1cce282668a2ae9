"""Every stream adds to `olp_proxy_tokens_total`, not only the captured ones and those whose
client asked for `include_usage`: the proxy asks upstream for the usage chunk itself and
keeps it from a client that did not ask for it."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import openai
import pytest

from proxy.completions import CompletionRelay
from proxy.relay import SSEParser
from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_scripted_upstream import (
    PROMPT_IDS,
    ScriptedUpstream,
    normalise,
    stream_events,
)

COMPLETION_TOKENS = 7  # the token ids of the scripted fragments


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def tokens(harness, tenant: str, direction: str) -> float:
    harness.settle()
    value = harness.ctx.metrics.registry.get_sample_value(
        "olp_proxy_tokens_total",
        {"direction": direction, "tenant": tenant, "policy_version": "base"},
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("tenant", "headers"),
    [("bob", {}), ("alice", {"X-OLP-Train": "0"})],  # no training / opted out: uncaptured
)
def test_an_uncaptured_stream_counts_its_tokens_and_the_client_sees_no_usage(
    make_proxy, scripted, tenant, headers
):
    harness, sink = make_proxy([scripted.url])
    direct = stream_events(scripted.url, None)  # what the client's own body gets from upstream
    relayed = stream_events(harness.base_url, KEYS[tenant], headers)
    assert normalise(relayed) == normalise(direct)
    assert not any("usage" in e for e in relayed if isinstance(e, dict))
    assert scripted.requests[-1]["stream_options"] == {"include_usage": True}
    assert tokens(harness, tenant, "in") == len(PROMPT_IDS)
    assert tokens(harness, tenant, "out") == COMPLETION_TOKENS
    stream_events(harness.base_url, KEYS[tenant], headers)
    assert tokens(harness, tenant, "out") == 2 * COMPLETION_TOKENS
    harness.drain()
    assert sink.trajectories == []


def test_a_client_that_asks_for_usage_still_gets_it_and_it_counts_once(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    relayed = stream_events(harness.base_url, KEYS["bob"], stream_options={"include_usage": True})
    assert relayed[-2]["usage"]["completion_tokens"] == COMPLETION_TOKENS
    assert scripted.requests[-1]["stream_options"] == {"include_usage": True}
    assert tokens(harness, "bob", "out") == COMPLETION_TOKENS


def test_the_client_s_other_stream_options_reach_upstream(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    stream_events(harness.base_url, KEYS["bob"], stream_options={"vendor": 1})
    assert scripted.requests[-1]["stream_options"] == {"vendor": 1, "include_usage": True}
    assert tokens(harness, "bob", "out") == COMPLETION_TOKENS


def test_an_uncaptured_stream_from_the_real_model_server_counts_its_tokens(proxy):
    harness, sink = proxy
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    chunks = list(
        api.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk
    assert tokens(harness, "bob", "in") > 0
    assert 0 < tokens(harness, "bob", "out") <= 4
    harness.drain()
    assert sink.trajectories == []


def test_drop_usage_keeps_every_other_byte_and_the_last_usage():
    """`_drop_usage` on reads as they come: an event split over two reads, a chunk with
    running usage (`continuous_usage_stats`), the usage chunk, an event that is no JSON."""
    relay = SimpleNamespace(usage=None)
    parser = SSEParser()
    first = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"say \\"usage\\""}}]}\n\n'
    running = (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    )
    usage_chunk = (
        b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    )
    odd = b'data: not json "usage"\n\n'
    reads = [first[:20], first[20:] + running, usage_chunk + odd + b"data: [DONE]\n\n"]
    out = b"".join(CompletionRelay._drop_usage(relay, parser.complete(read)) for read in reads)
    assert out == (
        first
        + b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
        + odd
        + b"data: [DONE]\n\n"
    )
    assert relay.usage == {"prompt_tokens": 3, "completion_tokens": 2}


@pytest.mark.parametrize(
    "framing",
    [
        pytest.param(b"\n\n", id="plain"),
        pytest.param(b"\r\n\r\n", id="crlf"),
        pytest.param(b"\n\n\n", id="extra-newline"),
    ],
)
def test_drop_usage_cuts_only_the_events_that_hold_usage(framing: bytes):
    """The usage chunk as the block's first, middle or last event, and a `\\r\\n` or an
    extra newline between events: every other event's bytes go out as they came."""
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}]}'
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    done = b"data: [DONE]"
    for events, kept in [
        ([usage, chunk, done], [chunk, done]),
        ([chunk, usage, chunk, done], [chunk, chunk, done]),
        ([chunk, chunk, usage], [chunk, chunk]),
    ]:
        relay = SimpleNamespace(usage=None)
        block = b"".join(event + framing for event in events)
        out = CompletionRelay._drop_usage(relay, SSEParser().complete(block))
        events_out = out.replace(b"\r\n", b"\n").split(b"\n\n")
        assert [e.strip(b"\n") for e in events_out if e.strip()] == kept
        assert relay.usage == {"prompt_tokens": 3, "completion_tokens": 2}
