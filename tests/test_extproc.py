"""The ext_proc processor through a real Envoy: tokenpools' filter, then an endpoint picker
that follows the EPP protocol, then emulated vLLM backends; the official openai client in
front. Every admission outcome the gateway's tests cover, the headers the data plane sees,
streams and whole answers settled on the engine's usage, and leases ended on every ending."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway_setup import KEYS, MODEL, config_data
from tests.servers import wait_for
from tests.stacks import Stack, authz_stack_of, stack_of
from tests.test_gateway_e2e import open_streams
from tokenpools.model.objectives import FAIRNESS_HEADER, OBJECTIVE_HEADER


@pytest.fixture(params=["BUFFERED", "FULL_DUPLEX_STREAMED"])
def extproc_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """ext_proc: requests' bodies buffered by Envoy, or sent full duplex (the processor
    buffers them and answers their headers once admission has decided)."""
    yield from stack_of(config_data("http://127.0.0.1:9"), request_mode=request.param)


@pytest.fixture(params=["BUFFERED", "FULL_DUPLEX_STREAMED", "ext_authz"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """Either way into Envoy: ext_proc (both request modes) or ext_authz with the access
    log; the admission outcomes are the same on each."""
    config = config_data("http://127.0.0.1:9")
    if request.param == "ext_authz":
        yield from authz_stack_of(config)
    else:
        yield from stack_of(config, request_mode=request.param)


def test_admitted_request_reaches_a_picked_backend_with_its_class(stack: Stack) -> None:
    answer = stack.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    completion = answer.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert answer.headers["x-tokenpools-entitlement"] == "gold"
    assert answer.headers["x-tokenpools-service-class"] == "guaranteed"
    assert "x-ratelimit-remaining-requests" in answer.headers
    seen = stack.picker.seen[-1]
    assert seen[OBJECTIVE_HEADER] == "pool-guaranteed"
    assert seen[FAIRNESS_HEADER] == "g"
    assert "authorization" not in seen  # the tenant's key stays with tokenpools
    stack.wait_all_ended()


def test_unknown_key_is_401_without_reaching_the_picker(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.envoy.url}/v1/chat/completions",
        headers={"Authorization": "Bearer sk-nobody"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert stack.picker.seen == []


def test_a_stream_settles_on_the_engines_usage_kept_from_a_client_that_did_not_ask(
    extproc_stack: Stack,
) -> None:
    log = extproc_stack.records()
    c = extproc_stack.client()
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
        )
    )
    assert all(ch.usage is None for ch in chunks)
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 6
    with_usage = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 6
    done = wait_for(lambda: list(log), lambda v: len(v) == 2, what="both flows recorded")
    assert [r.completion_tokens for r in done] == [6, 6]  # the engine's count, both times
    assert all(r.status == 200 and r.decision == "admitted" for r in done)
    assert done[0].prompt_tokens == with_usage[-1].usage.prompt_tokens


@pytest.mark.parametrize("request_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_request_without_max_tokens_gets_the_reserved_ceiling_written_into_its_body(
    request_mode: str,
) -> None:
    """The body is rewritten through Envoy (its length too): the engine generates exactly the
    ceiling admission reserved, not its own default."""
    config = config_data("http://127.0.0.1:9")
    config["entitlements"][0]["defaultMaxTokens"] = 7
    for stack in stack_of(config, request_mode=request_mode):
        reply = stack.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 7


def test_429_through_envoy_carries_retry_after_and_ratelimit_headers(stack: Stack) -> None:
    streams = open_streams(stack.envoy, "gold", 4)  # type: ignore[arg-type]  # gold's whole concurrency
    with pytest.raises(openai.RateLimitError) as limited:
        stack.client(max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4
        )
    headers = limited.value.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "4"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.value.body["code"] == "concurrency_limit"  # type: ignore[index]
    assert len(stack.picker.seen) == 4  # the refused one never reached the picker
    for s in streams:
        s.close()


def test_refusals_before_admission_answer_in_the_openai_shape(stack: Stack) -> None:
    key = {"Authorization": f"Bearer {KEYS['gold']}"}
    url = f"{stack.envoy.url}/v1/chat/completions"
    unknown = httpx.post(
        url, headers=key, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad = httpx.post(url, headers=key, content=b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    wrong = httpx.post(url, headers=key, json={"model": MODEL, "messages": [], "n": "two"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages"
    huge = httpx.post(url, headers=key, content=b"x" * 70000)
    assert huge.status_code == 413
    nobody = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert nobody.status_code == 401 and nobody.headers["www-authenticate"] == "Bearer"
    other = httpx.post(f"{stack.envoy.url}/v1/audio/speech", headers=key, json={})
    assert other.status_code == 404  # not governed: never passed on unadmitted
    get = httpx.get(url, headers=key)
    assert get.status_code == 405
    assert stack.picker.seen == []


def test_headers_a_client_sends_as_ours_are_replaced(stack: Stack) -> None:
    forged = {
        OBJECTIVE_HEADER: "pool-dedicated",
        FAIRNESS_HEADER: "someone-else",
        "x-tokenpools-service-class": "dedicated",
        "x-tokenpools-entitlement": "gold",
    }
    reply = stack.client("spot", default_headers=forged).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.usage is not None
    seen = stack.picker.seen[-1]
    assert seen[OBJECTIVE_HEADER] == "pool-spot"
    assert seen[FAIRNESS_HEADER] == "s"
    assert seen["x-tokenpools-service-class"] == "spot"
    assert seen["x-tokenpools-entitlement"] == "spot"


def test_a_client_that_hangs_up_mid_stream_ends_its_lease(extproc_stack: Stack) -> None:
    log = extproc_stack.records()
    (stream,) = open_streams(extproc_stack.envoy, "gold", 1, max_tokens=2000)  # type: ignore[arg-type]
    assert extproc_stack.in_flight() == {"gold": 1}
    stream.close()
    extproc_stack.wait_all_ended()
    (record,) = wait_for(lambda: list(log), what="the flow recorded")
    assert record.completion_tokens is not None and 1 <= record.completion_tokens < 2000


def test_a_backend_killed_mid_stream_ends_the_lease(stack: Stack) -> None:
    (stream,) = open_streams(stack.envoy, "gold", 1, max_tokens=5000)  # type: ignore[arg-type]
    for backend in stack.backends:
        backend.kill()
    with pytest.raises(httpx.RemoteProtocolError):  # Envoy resets the client's stream too
        stream.rest()
    stream.close()
    stack.wait_all_ended()
    stack.picker.endpoints = []  # and with no endpoint left, the picker answers 503: refunded
    r = httpx.post(
        f"{stack.envoy.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEYS['gold']}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert r.status_code == 503
    stack.wait_all_ended()


def test_a_preemptible_stream_is_evicted_for_guaranteed_work(extproc_stack: Stack) -> None:
    log = extproc_stack.records()
    streams = open_streams(extproc_stack.envoy, "batch", 8, max_tokens=2000)  # type: ignore[arg-type]
    reply = extproc_stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.usage is not None
    wait_for(extproc_stack.in_flight, lambda v: v.get("batch") == 7, what="one preemptible evicted")
    evicted = wait_for(
        lambda: [r for r in log if r.evicted], what="the evicted flow ended and recorded"
    )
    assert len(evicted) == 1 and evicted[0].entitlement == "batch"
    newest = streams[-1]  # the newest preemptible is the one to go: Envoy resets its stream
    with pytest.raises(httpx.RemoteProtocolError):
        newest.rest()
    for s in streams:
        s.close()


def test_answers_sent_full_duplex_are_sent_back_whole_and_settle() -> None:
    """Where the data plane sends the answer FULL_DUPLEX_STREAMED, every byte is the
    processor's to send back: streams arrive whole (the usage chunk kept from a client that
    did not ask), whole answers too, and both settle on the engine's counts."""
    for stack in stack_of(config_data("http://127.0.0.1:9"), answer_mode="FULL_DUPLEX_STREAMED"):
        log = stack.records()
        c = stack.client()
        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
            )
        )
        assert all(ch.usage is None for ch in chunks)
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 6
        whole = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert whole.usage is not None and whole.usage.completion_tokens == 5
        done = wait_for(lambda log=log: list(log), lambda v: len(v) == 2, what="both recorded")
        assert [r.completion_tokens for r in done] == [6, 5]
