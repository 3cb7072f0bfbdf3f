"""Watches back off instead of looping: an informer whose watch keeps failing, keeps getting
410 Gone, or keeps ending at once waits 1 s doubling to 30 s between attempts (with jitter,
here injected as none), and starts over once it gets an event. Driven one step at a time
against the API stand-in, with the waits recorded instead of slept."""

from __future__ import annotations

from typing import Any

from tests.kube.api_faults import Fault
from tests.kube.harness import Bench, bench, pool
from tokenpools.backoff import Backoff
from tokenpools.k8s.api import POOLS
from tokenpools.k8s.informer import Informer

__all__ = ["bench"]


def test_the_backoff_doubles_to_its_ceiling_with_jitter_on_top() -> None:
    backoff = Backoff(jitter=lambda: 0.0)
    assert [backoff.next() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    backoff.reset()
    assert backoff.next() == 1
    assert Backoff(jitter=lambda: 0.5).next() == 1.1  # up to a fifth more, never past 30
    assert Backoff(jitter=lambda: 0.999, failures=10).next() == 30


class _Waits:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.seconds.append(seconds)
        return False  # not stopped


def _informer(bench: Bench, waits: _Waits, elapsed: list[float] | None = None) -> Informer:
    timer = (lambda: elapsed[0]) if elapsed is not None else None
    return Informer(
        bench.kube, POOLS, None, lambda: None, watch_timeout_s=1,
        backoff=Backoff(jitter=lambda: 0.0), wait=waits,
        **({"timer": timer} if timer is not None else {}),
    )  # fmt: skip


def _requests(bench: Bench) -> list[Any]:
    return [r for r in list(bench.server.api) if r.url.path.endswith("/tokenpools")]


def test_a_watch_that_keeps_failing_backs_off(bench: Bench) -> None:
    bench.kube.create(POOLS, None, pool())
    waits = _Waits()
    informer = _informer(bench, waits)
    informer.step()  # the list
    assert [p["metadata"]["name"] for p in informer.items()] == ["qwen"] and waits.seconds == []
    bench.server.api.faults.append(Fault("watch", "tokenpools", status=500))
    before = len(_requests(bench))
    for _ in range(14):  # seven watches refused, each followed by a list
        informer.step()
    assert waits.seconds == [1, 2, 4, 8, 16, 30, 30]  # one wait per failed watch, growing
    assert len(_requests(bench)) - before == 14  # nothing asked between the waits
    assert [p["metadata"]["name"] for p in informer.items()] == ["qwen"]  # the cache is kept

    bench.server.api.faults.clear()  # the API server answers again: progress starts it over
    bench.kube.patch(POOLS, None, "qwen", {"spec": {"replicas": 3}})
    informer.step()  # the list after the last failure
    informer.step()  # a watch that delivers the change
    assert informer.backoff.failures == 0 and informer.failing_since is None


def test_410_after_every_relist_backs_off_after_the_first(bench: Bench) -> None:
    bench.kube.create(POOLS, None, pool())
    waits = _Waits()
    informer = _informer(bench, waits)
    informer.step()
    bench.server.api.faults.append(Fault("watch", "tokenpools", status=410))
    for _ in range(8):
        informer.step()
    assert informer.lists == 5
    assert waits.seconds == [2, 4, 8]  # the first relist at once, the next ones waited
    assert informer.failing_since is None  # a 410 is no failure of the API server


def test_a_watch_that_ends_at_once_with_nothing_backs_off(bench: Bench) -> None:
    bench.kube.create(POOLS, None, pool())
    waits, elapsed = _Waits(), [0.0]
    informer = _informer(bench, waits, elapsed)  # its watches take no time at all
    informer.step()
    for _ in range(4):
        informer.step()  # each watch ends (timeoutSeconds) with nothing in it, "at once"
    assert waits.seconds == [1, 2, 4, 8] and informer.lists == 1  # resumed, not relisted
