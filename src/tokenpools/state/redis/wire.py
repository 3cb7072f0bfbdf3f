"""The one declaration of the wire between RedisStore and its Lua script.

Where an argument sits in ARGV, which plan numbers follow, which hash field each counter and
lease column is read from: all of it is declared here, and the Lua side is generated from it (a
prelude of constants put in front of the script parts in state/redis/lua/), so the two cannot drift
by position. tests/test_redis_wire.py checks that every name the script uses is declared, and
the differential tests check the behaviour. Numbers travel as 17-significant-digit strings, so
a float survives the round trip exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from importlib.resources import files
from typing import Any

from tokenpools.control import backfill
from tokenpools.control.metering import BudgetHold, Charge, PendingUsage, UsageRow
from tokenpools.control.store import (
    INF,
    EntitlementCounters,
    Lease,
    PoolCounters,
    Reservation,
    ReservePlan,
)
from tokenpools.state.accounts import RESERVED_ONLY

KeyFn = Callable[[BudgetHold], str]

# Every call: ARGV[1] the operation, ARGV[2] the pool epoch the caller knows, ARGV[3] now,
# ARGV[4] the calling replica (the owner of the leases it books).
HEADER = ("op", "epoch", "now", "owner")
# A new lease, as adopt takes it and as each admission starts.
LEASE_ARGS = ("id", "ent", "tokens", "kv", "started", "expires", "pre", "res")
# One admission: how many arguments it has (this one included), when it is decided, the lease,
# its own numbers; then the plan's numbers, then the victims' names. Several may follow each
# other in one call, decided in that order. `more`: the next group is this request's next
# layer (another entitlement of its tenant in the pool), tried only if this one is refused.
# A metered lease (control/metering.py Meter): its ledger bucket ("" when none), its worst case
# (the tokens are the lease's), and how many budget holds follow the plan's numbers, each as
# HOLD_ARGS; the victims' names come after them.
METER_ARGS = ("bucket", "w_in", "w_out", "w_cost", "holds")
HOLD_ARGS = ("key", "measure", "limit", "until")
ADMIT_GROUP = (
    "size", "at", *LEASE_ARGS, "demand", "may_overcommit", "claim_share", "more", *METER_ARGS
)  # fmt: skip
PLAN_FIELDS = tuple(f.name for f in fields(ReservePlan))
# A lease end's charge besides the tokens (`used`): ignored when `used` is 'all' or 'taken'
# (the lease's worst case is charged).
FINISH_GROUP = ("id", "used", "observed", "at", "keep", "c_in", "c_out", "c_cached", "c_cost")
RECHARGE_ARGS = (
    "bucket", "w_in", "w_out", "w_tokens", "w_cost",
    "c_in", "c_out", "c_cached", "c_tokens", "c_cost", "holds",
)  # fmt: skip
# Each operation's own arguments, after the header.
OPS: dict[str, tuple[str, ...]] = {
    "configure_pool": ("b_rate", "b_depth", "pb_rate", "pb_depth", "new_epoch"),
    "configure_entitlement": ("name", "o_rate", "o_depth", "hold_c", "hold_k", "protected"),
    "remove_entitlement": ("name",),
    "admit": ADMIT_GROUP,  # then the plan's numbers, then the victims' names; repeated
    "adopt": LEASE_ARGS,
    # One group per lease end, repeated for several in one call, in the order they happened;
    # used: tokens, 'all', or 'taken' (Store.take_back: 'all', less what taking it back gives
    # back to the pool bucket); at: when it ended; keep: a lease not found there is remembered
    # as ended until then, so an admission of it that arrives late is refused (0: not).
    "finish": FINISH_GROUP,
    "renew": ("id", "expires"),
    # A lease that ended on its worst case charged `c_*` instead (Store.recharge): its worst
    # case, the charge, and how many budget holds follow, each as its key and measure.
    "recharge": RECHARGE_ARGS,
    # stale: a replica not heard from since then is gone, and its leases end
    "expire": ("stale",),
    "get_lease": ("id",),
    "preemptible": (),
    "resumable": (),
    "take_window": ("name",),
    "scores": ("name",),
    "set_scores": ("name", "debt", "burst", "priority", "peak_c", "peak_k"),
    "claim_update": ("period",),
    "pool_counters": (),
    "entitlement_counters": ("name",),
    "pending_usage": ("limit",),  # the oldest ledger rows not yet written, and their totals
    "ack_usage": (),  # then member ("<hour>:<bucket>"), version pairs committed to SQL
}
# Counter dataclass field -> the Lua hash field it is read from, in dataclass order.
POOL_COUNTERS = {
    "concurrency": "conc",
    "kv_tokens": "kv",
    "preemptible_concurrency": "pre_c",
    "preemptible_kv": "pre_k",
    "holdback_concurrency": "hold_c",
    "holdback_kv": "hold_k",
    "bucket": "b_level",
    "protected_bucket": "pb_level",
    "leases": "leases",
    "claimed_concurrency": "cl_c",
    "claimed_kv": "cl_k",
    "reclaimable_tokens": "recl",
}
ENTITLEMENT_COUNTERS = {
    "concurrency": "conc",
    "kv_tokens": "kv",
    "bucket": "o_level",
    "leases": "leases",
}
# A lease row in replies: its id, then these Lease fields from these lease hash fields.
LEASE_ROW = {
    "entitlement": "ent",
    "tokens": "tokens",
    "kv_tokens": "kv",
    "started_at": "started",
    "expires_at": "expires",
    "preemptible": "pre",
    "reserved_path": "reserved",
    "drew_own": "own",
    "resumable": "res",
}
# The admit reply: status ('ok' or a Shortfall), the three flags, the entitlement counters and
# the pool counters, the evicted leases' rows, what each budget hold has left, and the index
# (from 1; 0: none) of the hold that refused. For layers (groups joined by `more`): a list
# of those replies, one per layer tried, the last one the admission if any.
ADMIT_FLAGS = ("reserved", "own", "overcommit")


def _lua_list(names: Sequence[str]) -> str:
    return "{ " + ", ".join(f"'{n}'" for n in names) + " }"


def prelude() -> str:
    """The Lua constants generated from the declarations above."""
    # Only the called operation's table is built: the script runs this on every call.
    ops: list[str] = []
    for op, names in OPS.items():
        at = ", ".join(f"{name} = {len(HEADER) + i + 1}" for i, name in enumerate(names))
        ops.append(f"{'if' if not ops else 'elseif'} ARGV[1] == '{op}' then A = {{ {at} }}")
    return "\n".join(
        [
            "-- Generated by state/redis/wire.py: the argument and reply layout. Do not edit.",
            "local H = { " + ", ".join(f"{n} = {i + 1}" for i, n in enumerate(HEADER)) + " }",
            "local A = {}  -- the ARGV index of each argument of the called operation",
            *ops,
            "end",
            f"local PLAN_AT = {len(HEADER) + len(ADMIT_GROUP) + 1}  -- ARGV index of the plan",
            f"local PLAN_FIELDS = {_lua_list(PLAN_FIELDS)}",
            f"local FINISH_GROUP = {len(FINISH_GROUP)}  -- finish's arguments per lease end",
            f"local HOLDS_AT = {len(HEADER) + len(ADMIT_GROUP) + len(PLAN_FIELDS) + 1}",
            f"local HOLD_ARGS = {len(HOLD_ARGS)}",
            f"local POOL_COUNTERS = {_lua_list(list(POOL_COUNTERS.values()))}",
            f"local ENT_COUNTERS = {_lua_list(list(ENTITLEMENT_COUNTERS.values()))}",
            f"local LEASE_ROW = {_lua_list(list(LEASE_ROW.values()))}",
            f"local ADMIT_FLAGS = {_lua_list(ADMIT_FLAGS)}",
            f"local CLAIM_SIGMAS = {backfill.SPREAD_SIGMAS!r}  -- control/backfill.open_claims",
            f"local RESERVED_ONLY = '\\{ord(RESERVED_ONLY)}'  -- state/accounts.py",
            "",
        ]
    )


LUA_PARTS = ("storage.lua", "metering.lua", "leases.lua", "reserve.lua", "operations.lua")
SCRIPT = prelude() + "\n".join(
    files("tokenpools.state.redis").joinpath("lua", p).read_text() for p in LUA_PARTS
)


def args(op: str, **values: str) -> list[str]:
    """An operation's arguments after the header, in declared order."""
    names = OPS[op]
    if values.keys() != set(names):
        raise TypeError(f"{op} takes {names}, got {tuple(values)}")
    return [values[name] for name in names]


def num(x: float | bool) -> str:
    return repr(float(x))


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def lease(row: Sequence[Any], pool: str) -> Lease:
    text = [_text(v) for v in row]
    values: dict[str, Any] = {}
    for name, value in zip(LEASE_ROW, text[1:], strict=True):
        if name == "entitlement":
            values[name] = value
        elif name in ("preemptible", "reserved_path", "drew_own", "resumable"):
            values[name] = value == "1"
        else:
            values[name] = float(value)
    return Lease(lease_id=text[0], pool=pool, **values)


def pool_counters(reply: Sequence[bytes]) -> PoolCounters:
    values: dict[str, Any] = dict(zip(POOL_COUNTERS, map(float, reply), strict=True))
    values["leases"] = int(values["leases"])
    return PoolCounters(**values)


def entitlement_counters(reply: Sequence[bytes]) -> EntitlementCounters:
    values: dict[str, Any] = dict(zip(ENTITLEMENT_COUNTERS, map(float, reply), strict=True))
    values["leases"] = int(values["leases"])
    return EntitlementCounters(**values)


_plan_cache: dict[ReservePlan, list[str]] = {}


def plan_args(plan: ReservePlan) -> list[str]:
    args = _plan_cache.get(plan)
    if args is None:
        if len(_plan_cache) > 4096:
            _plan_cache.clear()
        args = _plan_cache[plan] = [num(getattr(plan, name)) for name in PLAN_FIELDS]
    return args


def lease_args(lease: Lease) -> list[str]:
    """A new lease as the script takes it, in LEASE_ARGS order."""
    values = {
        "id": lease.lease_id,
        "ent": lease.entitlement,
        "tokens": num(lease.tokens),
        "kv": num(lease.kv_tokens),
        "started": num(lease.started_at),
        "expires": num(lease.expires_at),
        "pre": "1" if lease.preemptible else "0",
        "res": "1" if lease.resumable else "0",
    }
    return [values[name] for name in LEASE_ARGS]


def admit_args(
    reservation: Reservation, now: float, more: bool = False, budget_key: KeyFn = str
) -> list[str]:
    """One admission's group of the admit operation, in ADMIT_GROUP order, then the plan's
    numbers, the budget holds and the victims' names (several groups may go in one call).
    `budget_key` names a hold's counter in Redis."""
    lease = reservation.lease
    meter = lease.meter
    if meter is None:
        metered = ["", "0", "0", "0", "0"]
        holds: list[str] = []
    else:
        w = meter.worst
        metered = [meter.bucket, num(w.input), num(w.output), num(w.cost), str(len(meter.holds))]
        holds = [
            a for h in meter.holds for a in (budget_key(h), h.measure, num(h.limit), num(h.until))
        ]
    group = [
        num(now),
        *lease_args(lease),
        num(reservation.demand),
        "1" if reservation.may_overcommit else "0",
        num(reservation.claim_share),
        "1" if more else "0",
        *metered,
        *plan_args(reservation.plan),
        *holds,
        *reservation.victims[: reservation.victim_count],
    ]
    return [str(len(group) + 1), *group]


def recharge_args(lease: Lease, charge: Charge, budget_key: KeyFn = str) -> list[str]:
    """The recharge operation's arguments, in RECHARGE_ARGS order, then the holds."""
    meter = lease.meter
    assert meter is not None
    w = meter.worst
    values = {
        "bucket": meter.bucket,
        "w_in": num(w.input),
        "w_out": num(w.output),
        "w_tokens": num(w.tokens),
        "w_cost": num(w.cost),
        "c_in": num(charge.input),
        "c_out": num(charge.output),
        "c_cached": num(charge.cached),
        "c_tokens": num(charge.tokens),
        "c_cost": num(charge.cost),
        "holds": str(len(meter.holds)),
    }
    holds = [a for h in meter.holds for a in (budget_key(h), h.measure)]
    return [*args("recharge", **values), *holds]


def layers_args(
    reservations: Sequence[Reservation], now: float, budget_key: KeyFn = str
) -> list[str]:
    """A request's layers as groups joined by `more`: Redis tries them in order, in one step."""
    last = len(reservations) - 1
    return [
        a
        for i, r in enumerate(reservations)
        for a in admit_args(r, now, more=i < last, budget_key=budget_key)
    ]


def pending_usage(source: str, reply: Sequence[Any]) -> PendingUsage:
    """A pending_usage reply: count, oldest, lost, then the rows."""
    count, oldest, lost, rows = reply
    return PendingUsage(
        [usage_row(source, row) for row in rows],
        int(_text(count)),
        float(_text(oldest)) if _text(oldest) else INF,
        int(_text(lost)),
    )


def usage_row(source: str, row: Sequence[Any]) -> UsageRow:
    """A pending_usage row: "<hour>:<bucket>", then field, value pairs ('v': its version)."""
    member, *pairs = (_text(v) for v in row)
    hour, bucket = member.split(":", 1)
    values = {pairs[i]: float(pairs[i + 1]) for i in range(0, len(pairs), 2)}
    version = int(values.pop("v", 0))
    return UsageRow(source, int(hour), bucket, values, version)
