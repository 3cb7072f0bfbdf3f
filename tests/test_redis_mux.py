"""The gateway's multiplexed Redis connection against a real redis-server: replies reach their
callers in order, one loop turn's calls go out in one write, a timed-out call does not shift
the replies of later ones, a lost connection fails what is in flight and the next call connects
again, scripts survive SCRIPT FLUSH, AUTH and SELECT are sent, and a demoted master is left."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from tests.servers import wait_for
from tokenpools.processes import free_port, redis_server
from tokenpools.state.redis.connect import async_client
from tokenpools.state.redis.mux import Address, Multiplexed

# Holds the server for 0.4 s (DEBUG SLEEP is disabled by default in Redis 7).
BUSY_400_MS = """local s = redis.call('TIME')
while true do
  local n = redis.call('TIME')
  if (n[1] - s[1]) * 1e6 + (n[2] - s[2]) > 400000 then return 1 end
end"""


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_concurrent_calls_get_their_own_replies_in_one_write(redis_url: str) -> None:
    async def go() -> tuple[list[Any], int]:
        client = async_client(redis_url, 1.0)
        await client.call("PING")
        protocol = client._protocol
        writes = 0
        write = protocol.transport.write

        def counting(data: bytes) -> None:
            nonlocal writes
            writes += 1
            write(data)

        protocol.transport.write = counting
        replies = await asyncio.gather(*(client.call("ECHO", f"m{i}") for i in range(200)))
        await client.aclose()
        return replies, writes

    replies, writes = run(go())
    assert replies == [f"m{i}".encode() for i in range(200)]
    assert writes == 1


def test_an_error_reply_fails_its_call_only(redis_url: str) -> None:
    async def go() -> list[Any]:
        client = async_client(redis_url, 1.0)
        out = await asyncio.gather(
            client.call("ECHO", "a"), client.call("NOSUCHCOMMAND"), client.call("ECHO", "b"),
            return_exceptions=True,
        )  # fmt: skip
        await client.aclose()
        return out

    a, error, b = run(go())
    assert (a, b) == (b"a", b"b")
    assert isinstance(error, redis.ResponseError) and "unknown command" in str(error)


def test_a_timed_out_call_leaves_later_replies_in_place(redis_url: str) -> None:
    async def go() -> tuple[BaseException | None, Any, Any]:
        client = async_client(redis_url, 0.2)
        await client.call("PING")
        slow = await asyncio.gather(client.call("EVAL", BUSY_400_MS, 0), return_exceptions=True)
        # The sleep's reply is still on its way; the next calls must not receive it. They wait
        # behind the busy server for the rest of its 0.4 s: give them the time to.
        client.timeout_s = 5.0
        after = await asyncio.gather(client.call("ECHO", "x"), client.call("ECHO", "y"))
        await client.aclose()
        return slow[0], after[0], after[1]

    timed_out, x, y = run(go())
    assert isinstance(timed_out, redis.TimeoutError)
    assert (x, y) == (b"x", b"y")


def test_a_lost_connection_fails_the_calls_in_flight_and_the_next_one_reconnects(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def go() -> tuple[BaseException, Any]:
        client = async_client(redis_url, 2.0)
        await client.call("CLIENT", "SETNAME", "victim")
        in_flight = asyncio.ensure_future(client.call("BLPOP", "never", "1"))
        await asyncio.to_thread(  # the BLPOP has reached the server: kill it there
            wait_for,
            lambda: [c["cmd"] for c in redis_client.client_list() if c["name"] == "victim"],
            lambda cmds: cmds == ["blpop"],
            what="the victim's BLPOP blocked at the server (its commands)",
        )
        await asyncio.to_thread(redis_client.client_kill_filter, _type="normal", skipme=True)
        lost = (await asyncio.gather(in_flight, return_exceptions=True))[0]
        again = await client.call("ECHO", "back")
        await client.aclose()
        return lost, again

    lost, again = run(go())
    assert isinstance(lost, redis.ConnectionError)
    assert again == b"back"


def test_a_script_is_loaded_again_after_script_flush(
    redis_url: str, redis_client: redis.Redis
) -> None:
    async def go() -> list[Any]:
        client = async_client(redis_url, 1.0)
        script = client.register_script("return ARGV[1] .. KEYS[1]")
        first = await script(keys=["k"], args=["v"])
        await client.call("SCRIPT", "FLUSH")
        again = await script(keys=["k"], args=["w"])
        cached = await client.call("SCRIPT", "EXISTS", script.sha)
        await client.aclose()
        return [first, again, cached]

    assert run(go()) == [b"vk", b"wk", [1]]


def test_auth_and_database_come_from_the_url() -> None:
    port = free_port()
    with redis_server(port, "--requirepass", "s3cret") as (_, _proc):
        url = f"redis://:s3cret@127.0.0.1:{port}/3"

        async def go() -> None:
            client = async_client(url, 1.0)
            await client.call("SET", "where", "here")
            await client.aclose()
            wrong = async_client(f"redis://:nope@127.0.0.1:{port}/0", 1.0)
            with pytest.raises(redis.ResponseError, match=r"WRONGPASS|invalid password"):
                await wrong.call("PING")
            await wrong.aclose()

        run(go())
        check = redis.Redis(port=port, password="s3cret", db=3)
        assert check.get("where") == b"here"
        assert redis.Redis(port=port, password="s3cret", db=0).get("where") is None


def test_an_unreachable_server_fails_within_the_timeout() -> None:
    async def go() -> None:
        client = async_client(f"redis://127.0.0.1:{free_port()}/0", 0.5)
        with pytest.raises(OSError):
            await client.call("PING")

    run(go())


def test_a_demoted_master_is_left_and_the_next_call_asks_where_the_master_is() -> None:
    with redis_server() as (master_url, _m), redis_server() as (replica_url, _r):
        master_port = int(master_url.rsplit(":", 1)[1].split("/")[0])
        replica_port = int(replica_url.rsplit(":", 1)[1].split("/")[0])
        redis.Redis(port=replica_port).replicaof("127.0.0.1", master_port)
        asked: list[int] = []
        answers = [replica_port, master_port]  # first a stale answer, as during a failover

        async def locate() -> Address:
            asked.append(answers[min(len(asked), 1)])
            return "127.0.0.1", asked[-1]

        async def go() -> tuple[BaseException, Any]:
            client = Multiplexed(locate, 1.0)
            refused = (await asyncio.gather(client.call("SET", "k", "v"), return_exceptions=True))[
                0
            ]
            written = await client.call("SET", "k", "v")
            await client.aclose()
            return refused, written

        refused, written = run(go())
        assert isinstance(refused, redis.ResponseError) and str(refused).startswith("READONLY")
        assert written == b"OK"
        assert asked == [replica_port, master_port]


def test_a_blocked_event_loop_is_not_a_late_redis(redis_url: str) -> None:
    """The loop is blocked for 0.3 s between a call and its write (a slow callback, a long
    garbage collection): its 50 ms timer fires late, and measures the loop, not Redis, so the
    call gets its reply. Redis itself busy for 0.4 s still times out."""

    async def go() -> tuple[Any, Any]:
        client = async_client(redis_url, 0.05)
        await client.call("PING")
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 0.3)  # runs before the call's write
        blocked = await client.call("ECHO", "through")
        slow = await asyncio.gather(client.call("EVAL", BUSY_400_MS, 0), return_exceptions=True)
        await client.aclose()
        return blocked, slow[0]

    blocked, slow = run(go())
    assert blocked == b"through"
    assert isinstance(slow, redis.TimeoutError)
