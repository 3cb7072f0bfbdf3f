"""Clients for `state.url`:

- one Redis server: `redis://[user:password@]host:port[/db]` (or `rediss://` for TLS);
- a Redis Cluster: `redis+cluster://host:port[,host:port...]` (or `rediss+cluster://`), the
  nodes to discover it from. Each pool's keys share one hash tag, so a pool lives on one shard
  and its script runs there; pools spread over the shards by their names;
- Redis Sentinel: `redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]`,
  the sentinels and the name they monitor the master by; the password is the data nodes'.
  After a failover the clients ask the sentinels again and follow the promoted replica.

Every client waits at most `timeout_s` per call and does not retry on its own: a failed call
becomes the store's outage policy at once, since a call that timed out may have taken effect
(an admission retried blindly could book twice). A cluster client that meets a moved slot (a
replica promoted) fails that call and learns the new layout, so the next call goes there.

The gateway's hot path on one server (plain or behind Sentinel) shares one multiplexed
connection (state/redis/mux.py); TLS and the cluster use redis-py's asyncio clients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from tokenpools.state.redis.mux import Address, Multiplexed

# Calls in flight per replica on the hot path. Redis runs one script at a time, so more buy
# nothing; a request beyond them waits for one (bounded: each call holds it at most one
# timeout), which is congestion here, not an unreachable Redis.
CONNECTIONS = 32
POOL_WAIT_S = 5.0
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEME = "redis+sentinel"


def options(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # no hidden retries: a request waits one timeout
    }


def _seeds(netloc: str, default_port: int) -> list[tuple[str, int]]:
    seeds = []
    for hostport in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.rpartition(":")
        seeds.append((host or hostport, int(port or default_port)))
    return seeds


def _cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """The single-node URL redis-py's cluster client parses, and every seed node."""
    parts = urlsplit(url)
    seeds = _seeds(parts.netloc, 6379)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    first = f"{auth}{seeds[0][0]}:{seeds[0][1]}"
    single = urlunsplit((CLUSTER_SCHEMES[parts.scheme], first, parts.path, parts.query, ""))
    return single, seeds


@dataclass(frozen=True)
class SentinelAddress:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelAddress:
        parts = urlsplit(url)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(f"{url!r}: a sentinel URL names the service: .../<service>[/<db>]")
        return cls(
            sentinels=_seeds(parts.netloc, 26379),
            service=unquote(path[0]),
            db=int(path[1]) if len(path) > 1 else 0,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )


def sync_client(url: str, timeout_s: float) -> Any:
    scheme = urlsplit(url).scheme
    if scheme == SENTINEL_SCHEME:
        address = SentinelAddress.parse(url)
        sentinel = redis.sentinel.Sentinel(
            address.sentinels, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return sentinel.master_for(
            address.service,
            db=address.db,
            username=address.username,
            password=address.password,
            **options(timeout_s),
        )
    if scheme not in CLUSTER_SCHEMES:
        return redis.Redis.from_url(url, **options(timeout_s))
    single, seeds = _cluster_nodes(url)
    return redis.cluster.RedisCluster.from_url(
        single,
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in seeds],
        retry=Retry(NoBackoff(), 0),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


def async_client(url: str, timeout_s: float) -> Any:
    scheme = urlsplit(url).scheme
    if scheme == SENTINEL_SCHEME:
        address = SentinelAddress.parse(url)
        sentinel = redis.asyncio.sentinel.Sentinel(
            address.sentinels, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

        async def master() -> Address:
            host, port = await sentinel.discover_master(address.service)
            return str(host), int(port)

        return Multiplexed(master, timeout_s, address.username, address.password, address.db)
    if scheme == "redis":
        params = parse_url(url)

        async def server() -> Address:
            return params.get("host", "localhost"), int(params.get("port", 6379))

        return Multiplexed(
            server, timeout_s, params.get("username"), params.get("password"), params.get("db", 0)
        )
    if scheme not in CLUSTER_SCHEMES:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=CONNECTIONS,
            timeout=POOL_WAIT_S,
            **options(timeout_s),
        )
        return redis.asyncio.Redis(connection_pool=pool)
    single, seeds = _cluster_nodes(url)
    return redis.asyncio.cluster.RedisCluster.from_url(
        single,
        startup_nodes=[redis.asyncio.cluster.ClusterNode(h, p) for h, p in seeds],
        retry=Retry(NoBackoff(), 0),
        # no cap: redis-py's asyncio cluster client fails a call over the cap (and drops the
        # node's other connections with it) rather than making it wait
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
