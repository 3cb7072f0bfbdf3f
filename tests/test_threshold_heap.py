"""White-box check of the memory store's lazy threshold heap against a brute-force oracle:
the lowest priority in flight among the *other* entitlements, under random bookings, endings
and priority changes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenpools.control.store import INF, BucketSpec, Lease, Reservation, ReservePlan, Scores
from tokenpools.state.memory import MemoryStore

NAMES = [f"e{i}" for i in range(6)]
# A plan every booking passes: the test is about the heap, not the limits.
OPEN = ReservePlan(
    ent_concurrency=INF,
    ent_kv=INF,
    own_required=False,
    base_concurrency=0.0,
    base_kv=0.0,
    reserved_concurrency=INF,
    reserved_kv=INF,
    reserved_bucket_floor=-INF,
    overcommit_concurrency=INF,
    overcommit_kv=INF,
    overcommit_bucket_floor=-INF,
    shared_concurrency=INF,
    shared_kv=INF,
    nonpreemptible_concurrency=INF,
    nonpreemptible_kv=INF,
    surplus=False,
    shared_bucket_floor=-INF,
    nonpreemptible_bucket_floor=-INF,
    contended_concurrency=INF,
    contended_kv=INF,
    contended_bucket=-INF,
    contention_window_s=2.0,
    priority_margin=1.0,
)

events = st.lists(
    st.one_of(
        st.tuples(st.just("book"), st.sampled_from(NAMES)),
        st.tuples(st.just("end"), st.integers(0, 50)),
        st.tuples(st.just("priority"), st.sampled_from(NAMES), st.integers(0, 5)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_threshold_matches_brute_force(script: list[tuple[object, ...]]) -> None:
    store = MemoryStore()
    store.configure_pool("p", BucketSpec(INF, INF), BucketSpec(0.0, 0.0), 0.0)
    for name in NAMES:
        store.configure_entitlement(name, "p", BucketSpec(INF, INF), 0.0, 0.0, 0.0)
        store.set_scores(name, Scores(priority=float(NAMES.index(name) % 3)), 0.0)
    live: list[Lease] = []
    seq = 0
    for event in script:
        if event[0] == "book":
            seq += 1
            lease = Lease(str(seq), "p", event[1], 1.0, 1.0, 0.0, 1e9, False)
            assert (
                store.admit(Reservation(lease, OPEN, 0.0, (), 0, False, 0.0), 0.0).shortfall is None
            )
            live.append(lease)
        elif event[0] == "end" and live:
            lease = live.pop(event[1] % len(live))
            assert store.release(lease.lease_id, 0.0) is lease
        elif event[0] == "priority":
            store.set_scores(event[1], Scores(priority=float(event[2])), 0.0)
        pool = store._pools["p"]
        for name in NAMES:
            others = [
                store.scores(x.entitlement, 0.0).priority for x in live if x.entitlement != name
            ]
            expected = min(others) if others else -INF
            assert pool.threshold(name, store._ents) == expected
