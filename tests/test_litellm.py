"""tokenpools inside a real LiteLLM proxy (tokenpools.integrations.litellm), end to end.

Real processes and sockets on loopback: the emulator (in a thread here), redis-server, and a
LiteLLM proxy (the version `make test` installs into .venv-litellm) whose config names the
integration's custom auth and callback. The official openai client drives it. The tokenpools
config keeps its ledger in Redis, so this test reads the pool's counters where LiteLLM's
workers share them; every test ends with them at zero.

Marked `litellm`: `pytest -m 'not litellm'` leaves them out where LiteLLM is not installed.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from tests.gateway_setup import FAST
from tests.servers import ServerThread, wait_until
from tests.test_hostile_input import HEADER_BYTES, chat_request, send
from tokenpools.control.core import DecisionCore
from tokenpools.control.store import Store
from tokenpools.emulator.app import make_app as make_emulator
from tokenpools.emulator.server import EMULATOR
from tokenpools.model.config import parse_config
from tokenpools.model.keys import hash_key
from tokenpools.processes import free_port, wait_port
from tokenpools.state.redis.store import RedisStore

pytestmark = pytest.mark.litellm

ROOT = Path(__file__).resolve().parent.parent
LITELLM = Path(os.environ.get("TOKENPOOLS_LITELLM", ROOT / ".venv-litellm/bin/litellm"))
KEYS = {"gold": "sk-gold-1", "spot": "sk-spot-1", "batch": "sk-batch-1", "capped": "sk-capped-1"}
CAPPED_LIMIT = 120  # tokens, for the lifetime of the capped entitlement
ENTITLEMENTS = ("gold", "spot", "batch")
UPDATE_PERIOD_S = 3600
PREFIX = "litellm-tests"  # its own keys on the session's Redis: other tests leave theirs


def tokenpools_config(redis_url: str) -> dict[str, Any]:
    def ent(name: str, service_class: str, **more: Any) -> dict[str, Any]:
        keys = [hash_key(KEYS[name])]
        return {"name": name, "tenantId": name, "pool": "p", "serviceClass": service_class,
                "apiKeys": keys, **more}  # fmt: skip

    return {
        # backfillWindowS 0: spot and batch fill the pool at once (tests/gateway_setup.py)
        "policy": {"retryAfterMinS": 1, "updatePeriodS": UPDATE_PERIOD_S, "backfillWindowS": 0},
        # 1 character per token: the estimate the admission reserves is far from the engine's
        # count, so a settlement on the engine's usage is told from one on the reservation
        "gateway": {"charsPerToken": 1},
        "state": {"backend": "redis", "url": redis_url, "keyPrefix": PREFIX},
        "pools": [
            {
                "name": "p",
                "model": "Qwen3-8B",
                "servedModels": [MODEL, BROKEN],
                "perReplica": {"tokensPerSecond": 100000, "kvTokens": 65536, "concurrency": 8},
            }
        ],
        "entitlements": [
            ent("gold", "guaranteed", sloTargetMs=1000, concurrency=4),
            ent("spot", "spot"),
            ent("batch", "preemptible"),
            ent("capped", "elastic", concurrency=2),
        ],
        "budgets": [
            {"name": "capped-total", "entitlement": "capped", "limit": CAPPED_LIMIT,
             "window": "lifetime"},
        ],
    }  # fmt: skip


def documented_config() -> dict[str, Any]:
    """The LiteLLM config docs/litellm.md gives: its first YAML block."""
    text = (ROOT / "docs/litellm.md").read_text()
    return dict(yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0]))


DOCUMENTED = documented_config()
MODEL = DOCUMENTED["model_list"][0]["model_name"]
BROKEN = f"{MODEL}-broken"  # routed to a port where nothing listens


def litellm_config(backend: str) -> dict[str, Any]:
    """The documented config, its model served by `backend`, and one more that fails."""
    config = copy.deepcopy(DOCUMENTED)
    served = config["model_list"][0]
    served["litellm_params"]["api_base"] = f"{backend}/v1"
    broken = copy.deepcopy(served)
    broken["model_name"] = BROKEN
    broken["litellm_params"]["api_base"] = f"http://127.0.0.1:{free_port()}/v1"
    config["model_list"].append(broken)
    return config


class Stack:
    def __init__(self, url: str, emulator: ServerThread, store: Store, config: Path) -> None:
        self.url = url
        self.config = config  # the tokenpools config file LiteLLM follows
        self.emulator = emulator
        self.store = store

    def client(self, who: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[who], max_retries=0)

    def submitted(self) -> int:
        return int(self.emulator.call(lambda: self.emulator.app[EMULATOR].submitted))

    def in_flight(self) -> float:
        return self.store.pool_counters("p", time.time()).concurrency

    def settled(self, who: str) -> float:
        """Tokens settled for `who` since the last call (reads and resets its window)."""
        return self.store.take_window(who, time.time()).settled_tokens


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not LITELLM.exists():
        pytest.fail(f"{LITELLM} is missing: `make test` installs LiteLLM into .venv-litellm")
    work = tmp_path_factory.mktemp("litellm")
    emulator = ServerThread(make_emulator(FAST, speed=1.0))
    config = tokenpools_config(redis_url)
    (work / "tokenpools.yaml").write_text(yaml.safe_dump(config))
    (work / "litellm.yaml").write_text(yaml.safe_dump(litellm_config(emulator.url)))
    proc, port = start_litellm(work, {"TOKENPOOLS_CONFIG": str(work / "tokenpools.yaml")})
    try:
        # a core of our own on the same Redis: its store knows the pool of each entitlement
        core = DecisionCore(
            parse_config(config), RedisStore(redis_url, prefix=PREFIX), now=time.time()
        )
        # This process claims the update of this period and the next, so LiteLLM's ticks never
        # take the windows (the settled tokens) the tests read.
        period = int(time.time() // UPDATE_PERIOD_S)
        for p in (period, period + 1):
            assert core.store.claim_update("p", p, time.time())
        stack = Stack(f"http://127.0.0.1:{port}", emulator, core.store, work / "tokenpools.yaml")
        yield stack
    finally:
        proc.terminate()
        proc.wait(20)
        emulator.stop()


def start_litellm(
    work: Path, tokenpools_env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], int]:
    """LiteLLM's proxy on `work`/litellm.yaml, its log in `work`, with the integration's
    environment; once it listens: the process and its port."""
    port = free_port()
    env = {
        **os.environ,
        **tokenpools_env,
        "LITELLM_MASTER_KEY": "sk-unused-Master-Key-0123456789",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet at start
        # the emulator streams one word over and over, which LiteLLM takes for a looping model
        "REPEATED_STREAMING_CHUNK_LIMIT": "1000000",
    }
    with (work / "litellm.log").open("wb") as log:
        proc = subprocess.Popen(
            [str(LITELLM), "--config", str(work / "litellm.yaml"), "--port", str(port),
             "--host", "127.0.0.1"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_port(port, proc, timeout_s=120)
    except BaseException:
        proc.kill()
        proc.wait(20)
        raise
    return proc, port


@pytest.fixture
def lite(stack: Stack) -> Iterator[Stack]:
    """The stack; afterwards nothing is in flight or reserved in the pool or any entitlement."""
    yield stack
    now = time.time()
    wait_until(lambda: stack.in_flight() == 0)
    pool = stack.store.pool_counters("p", now)
    assert (pool.concurrency, pool.kv_tokens, pool.preemptible_concurrency) == (0, 0, 0)
    for name in ENTITLEMENTS:
        e = stack.store.entitlement_counters(name, now)
        assert (e.concurrency, e.kv_tokens, e.leases) == (0, 0, 0), name


def _chat(max_tokens: int = 8, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, **more}  # fmt: skip


def _hold(stack: Stack, who: str, count: int, max_tokens: int = 400) -> list[threading.Thread]:
    """`count` long streams from `who`, each reading to its end in a thread of its own."""

    def one() -> None:
        try:
            for _ in stack.client(who).chat.completions.create(**_chat(max_tokens), stream=True):
                pass
        except openai.APIError:
            pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def test_whole_and_streamed_answers_settle_on_the_engines_usage(lite: Stack) -> None:
    lite.settled("gold")
    raw = lite.client("gold").chat.completions.with_raw_response.create(**_chat(5))
    assert int(raw.headers["x-ratelimit-limit-requests"]) == 4  # gold's concurrency
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 3  # this one in flight
    whole = raw.parse()
    assert whole.usage is not None and whole.usage.completion_tokens == 5
    raw_stream = lite.client("gold").chat.completions.with_raw_response.create(
        **_chat(7), stream=True
    )
    assert "x-ratelimit-remaining-tokens" in raw_stream.headers
    chunks = list(raw_stream.parse())
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) == 7
    assert all(c.usage is None for c in chunks)  # the usage chunk asked for is kept from them
    # the engine counts "hello there" as a few tokens; the 1-char estimate as 11 and more
    engine_prompt = whole.usage.prompt_tokens
    assert engine_prompt < 11
    wait_until(lambda: lite.in_flight() == 0)
    assert lite.settled("gold") == 2 * engine_prompt + 5 + 7


def test_a_refused_spot_request_is_a_429_with_retry_after_in_one_round_trip(lite: Stack) -> None:
    held = []  # open streams: admitted, in flight until closed
    try:
        for _ in range(20):  # until spot holds all it may borrow
            try:
                held.append(lite.client("spot").chat.completions.create(**_chat(400), stream=True))
            except openai.RateLimitError:
                break
        assert 0 < len(held) < 20
        before = lite.submitted()
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            lite.client("spot").chat.completions.create(**_chat())
        took = time.monotonic() - started
    finally:
        for stream in held:
            stream.close()
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0
    reason = headers["x-tokenpools-reason"]
    assert reason in {"pool_full", "burst_exhausted", "overloaded"}
    assert reason in refused.value.message
    assert lite.submitted() == before  # neither LiteLLM nor the client tried the engine
    assert took < 2.0, took  # one round trip: no retry hidden inside LiteLLM


def test_guaranteed_requests_within_baseline_are_admitted_while_spot_floods(lite: Stack) -> None:
    flood = _hold(lite, "spot", 16)
    wait_until(lambda: lite.in_flight() >= 4)
    results: list[int] = []

    def gold() -> None:
        reply = lite.client("gold").chat.completions.create(**_chat(20))
        results.append(reply.usage.completion_tokens if reply.usage else -1)

    golds = [threading.Thread(target=gold) for _ in range(4)]  # its whole baseline at once
    for t in golds:
        t.start()
    for t in golds:
        t.join(30)
    assert results == [20, 20, 20, 20]
    for t in flood:
        t.join(30)


def test_a_client_disconnect_mid_stream_settles(lite: Stack) -> None:
    lite.settled("gold")
    body = _chat(400, stream=True)
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"{lite.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {KEYS['gold']}"},
        ) as r,
    ):
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
        assert lite.in_flight() == 1
    wait_until(lambda: lite.in_flight() == 0)
    charged = lite.settled("gold")
    assert 0 < charged < 11 + 400  # what was streamed, not the whole reservation


def test_a_failure_inside_litellm_leaks_nothing(lite: Stack) -> None:
    with pytest.raises(openai.APIError):
        lite.client("gold").chat.completions.create(**{**_chat(), "model": BROKEN})
    with pytest.raises(openai.APIError):
        list(
            lite.client("gold").chat.completions.create(**{**_chat(), "model": BROKEN}, stream=True)
        )


def test_refusals_before_admission_name_the_problem(lite: Stack) -> None:
    bad_key = openai.OpenAI(base_url=f"{lite.url}/v1", api_key="sk-nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(**_chat())
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        lite.client("gold").chat.completions.create(**{**_chat(), "model": "other"})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        lite.client("gold").chat.completions.create(**_chat(10**7))


def test_a_preempted_stream_ends_with_an_error_event(lite: Stack) -> None:
    batches = [
        lite.client("batch").chat.completions.create(**_chat(2000), stream=True) for _ in range(8)
    ]
    assert lite.in_flight() == 8  # the whole pool, gold's idle baseline included
    # gold takes back a slot of its baseline: one batch stream is evicted for it
    assert lite.client("gold").chat.completions.create(**_chat(10)).usage is not None
    ends = []
    for stream in batches:
        if stream.response.is_closed:
            ends.append("ended")
            continue
        try:
            for _ in zip(stream, range(300), strict=False):  # the evicted end within these
                pass
            ends.append("running")
        except openai.APIError as exc:
            ends.append(str(exc))
        finally:
            stream.close()
    preempted = [e for e in ends if "preempted by higher-priority work" in e]
    assert len(preempted) == 1 and ends.count("running") == 7, ends


def test_an_entitlement_added_to_the_config_file_is_adopted(lite: Stack) -> None:
    late = openai.OpenAI(base_url=f"{lite.url}/v1", api_key="sk-late-1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        late.chat.completions.create(**_chat())
    config = yaml.safe_load(lite.config.read_text())
    config["entitlements"].append(
        {"name": "late", "tenantId": "late", "pool": "p", "serviceClass": "spot",
         "apiKeys": [hash_key("sk-late-1")]}
    )  # fmt: skip
    lite.config.write_text(yaml.safe_dump(config))

    def admitted() -> bool:
        try:
            return late.chat.completions.create(**_chat(3)).usage is not None
        except openai.AuthenticationError:
            return False

    wait_until(admitted, timeout_s=15)  # the file is followed every 2 s


CHECK_VIRTUAL_KEYS = """
from litellm.proxy._types import UserAPIKeyAuth
from tokenpools.integrations.litellm import proxy_handler_instance as hook
named = {
    "metadata": UserAPIKeyAuth(api_key="k", metadata={"tokenpools_entitlement": "gold"}),
    "team metadata": UserAPIKeyAuth(api_key="k", team_metadata={"tokenpools_entitlement": "spot"}),
    "tenant metadata": UserAPIKeyAuth(api_key="k", metadata={"tokenpools_tenant": "spot"}),
    "team alias": UserAPIKeyAuth(api_key="k", team_id="a1b2", team_alias="batch"),
    "unknown team": UserAPIKeyAuth(api_key="k", team_id="a1b2", team_alias="nobody"),
}
callers = {case: hook.caller_of(auth) for case, auth in named.items()}
print({case: c and (c.tenant, c.entitlement) for case, c in callers.items()})
"""


def test_litellm_virtual_keys_name_their_tenant_or_entitlement_by_metadata_or_team(
    stack: Stack,
) -> None:
    """Without our custom auth, LiteLLM's own keys (from its database, which is not run here)
    reach the callback as these objects: a tenant (all its entitlements, by the request's
    model) or, as before tenants, one entitlement."""
    env = {**os.environ, "TOKENPOOLS_CONFIG": str(stack.config)}
    python = LITELLM.parent / "python"
    out = subprocess.run([python, "-c", CHECK_VIRTUAL_KEYS], env=env, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.strip().splitlines()[-1] == str(
        {
            "metadata": ("gold", "gold"),
            "team metadata": ("spot", "spot"),
            "tenant metadata": ("spot", None),
            "team alias": ("batch", None),
            "unknown team": None,
        }
    )


def test_a_preempted_whole_answer_is_cut_and_its_lease_ends(lite: Stack) -> None:
    errors: list[openai.APIError] = []

    def batch() -> None:
        try:
            lite.client("batch").chat.completions.create(**_chat(300))
        except openai.APIError as exc:
            errors.append(exc)

    batches = [threading.Thread(target=batch) for _ in range(8)]
    for t in batches:
        t.start()
    wait_until(lambda: lite.in_flight() == 8)
    assert lite.client("gold").chat.completions.create(**_chat(10)).usage is not None
    for t in batches:
        t.join(30)
    # LiteLLM has no way to answer a cancelled call: the client sees its 500
    assert len(errors) == 1 and isinstance(errors[0], openai.InternalServerError), errors


def test_calls_tokenpools_does_not_govern_are_refused(lite: Stack) -> None:
    with pytest.raises(openai.PermissionDeniedError, match="not governed"):
        lite.client("gold").images.generate(model=MODEL, prompt="a pool of tokens")


def test_a_budget_is_enforced_inside_litellm_as_at_the_gateway(lite: Stack) -> None:
    """The same budget, the same exactness: admitted answers say what is left; the request
    that does not fit is a 429 insufficient_quota naming it; Redis holds used ≤ the limit."""
    client = lite.client("capped")
    raw = client.chat.completions.with_raw_response.create(**_chat(20))
    assert raw.headers["x-tokenpools-budget"] == "capped-total"
    assert int(raw.headers["x-tokenpools-budget-remaining"]) < CAPPED_LIMIT
    refused = None
    for _ in range(10):
        try:
            client.chat.completions.create(**_chat(20))
        except openai.RateLimitError as exc:
            refused = exc
            break
    assert refused is not None
    assert refused.response.headers["x-tokenpools-reason"] == "insufficient_quota"
    assert "capped-total" in refused.message
    wait_until(lambda: lite.in_flight() == 0)
    key = f"{PREFIX}:{{p}}:b:capped-total@lifetime"
    used, held = (float(v or 0) for v in lite.store.client.hmget(key, "used", "held"))
    assert 0 < used <= CAPPED_LIMIT and held == 0


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(key=HEADER_BYTES)
def test_any_key_is_refused_cleanly_inside_litellm(stack: Stack, key: bytes) -> None:
    """The hostile-input strategies where they apply inside LiteLLM: its custom auth (keys).
    Bytes LiteLLM's server refuses as HTTP are its own; everything else is a 401, never a 5xx."""
    body = json.dumps(_chat()).encode()
    raw = chat_request(b"Authorization: Bearer " + key, body=body)
    status, answer = send(stack.url, raw)
    assert status in (400, 401), (key, status, answer[:300])
    if status == 401 and len(key) >= 12:
        assert key not in answer
