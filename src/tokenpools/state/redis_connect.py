"""Clients for `state.url`: one Redis server (`redis://`, `rediss://`) or a Redis Cluster
(`redis+cluster://host:port[,host:port...]`, `rediss+cluster://...`: the nodes to discover it
from). Each pool's keys share one hash tag, so a pool lives on one shard and its script runs
there; pools spread over the shards by their names.

Every client waits at most `timeout_s` per call and does not retry on its own: a failed call
becomes the store's outage policy at once, since a call that timed out may have taken effect
(an admission retried blindly could book twice). A cluster client that meets a moved slot (a
replica promoted) fails that call and learns the new layout, so the next call goes there."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import hiredis
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

# Connections to one Redis server per replica. Redis runs one script at a time, so more buy
# nothing; a request beyond them waits for one (bounded: each call holds it at most one
# timeout), which is congestion here, not an unreachable Redis.
CONNECTIONS = 32
POOL_WAIT_S = 5.0
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def options(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # no hidden retries: a request waits one timeout
    }


def _cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """The single-node URL redis-py's cluster client parses, and every seed node."""
    parts = urlsplit(url)
    seeds = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = hostport.rpartition(":")
        seeds.append((host or hostport, int(port or 6379)))
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    first = f"{auth}{seeds[0][0]}:{seeds[0][1]}"
    single = urlunsplit((CLUSTER_SCHEMES[parts.scheme], first, parts.path, parts.query, ""))
    return single, seeds


def sync_client(url: str, timeout_s: float) -> Any:
    if not is_cluster(url):
        return redis.Redis.from_url(url, **options(timeout_s))
    single, seeds = _cluster_nodes(url)
    return redis.cluster.RedisCluster.from_url(
        single,
        startup_nodes=[redis.cluster.ClusterNode(h, p) for h, p in seeds],  # type: ignore[no-untyped-call]
        retry=Retry(NoBackoff(), 0),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


class _HiredisPacking(redis.asyncio.Connection):
    """Commands packed by hiredis (a dependency): redis-py's asyncio connection packs them in
    Python, a fifth of the gateway's CPU per admission when profiled."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [hiredis.pack_command(args)]


def async_client(url: str, timeout_s: float) -> Any:
    if not is_cluster(url):
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=CONNECTIONS,
            timeout=POOL_WAIT_S,
            connection_class=_HiredisPacking,
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
