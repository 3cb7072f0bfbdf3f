"""How an entitlement's service class reaches a Kubernetes inference stack (the Gateway API
Inference Extension's InferencePool with llm-d's endpoint picker): one InferenceObjective per
pool and class, whose priority is llm-d's band, and the headers the ext_proc processor sets on
each admitted request so the picker files it under that band and the tenant's flow.

One declaration for both sides: `tokenpools k8s render` and the operator emit the objectives
from it, the processor names them from it (a test checks they agree)."""

from __future__ import annotations

import functools
import hashlib
import re

from tokenpools.model.pool import SchedulingPolicy
from tokenpools.model.service_class import ServiceClass

# llm-d reads these off the request (pkg/epp: the objective's name, and the flow's fairness key)
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
# tokenpools' own: the entitlement charged and its class (also sent back to the client)
ENTITLEMENT_HEADER = "x-tokenpools-entitlement"
CLASS_HEADER = "x-tokenpools-service-class"
# what a client may not send: the processor strips any copy before it sets its own
SET_BY_PROCESSOR = (OBJECTIVE_HEADER, FAIRNESS_HEADER, ENTITLEMENT_HEADER, CLASS_HEADER)

# The paper's order as llm-d's bands (higher is served first; negative is sheddable: llm-d may
# refuse it under saturation and evict it in flight). Dedicated and guaranteed share a band:
# both are admitted only within their bound baselines, so neither can starve the other.
PRIORITY: dict[ServiceClass, int] = {
    ServiceClass.DEDICATED: 10,
    ServiceClass.GUARANTEED: 10,
    ServiceClass.ELASTIC: 0,
    ServiceClass.SPOT: -10,
    ServiceClass.PREEMPTIBLE: -20,
}


def engine_priority(service_class: ServiceClass) -> int:
    """The class's priority as vLLM reads it under --scheduling-policy priority (lower is
    served first): its band negated, as llm-d's router writes it into the body."""
    return -PRIORITY[service_class]


def carried_priority(
    scheduling_policy: SchedulingPolicy, service_class: ServiceClass
) -> int | None:
    """The engine priority an admitted request of the class carries to engines that schedule
    by `scheduling_policy`; None: it carries none (a fcfs engine orders by arrival). The gateway
    writes it into the body (admission/clearing.py), the simulator hands it to its engines."""
    return engine_priority(service_class) if scheduling_policy == "priority" else None


_NOT_DNS = re.compile(r"[^a-z0-9-]+")
_MAX_NAME = 63


@functools.lru_cache(maxsize=4096)  # named on every admitted request: computed once per pair
def objective_name(pool: str, service_class: ServiceClass) -> str:
    """The InferenceObjective of a pool's class: `<pool>-<class>` as a DNS label (a name too
    long or not a label is cut and made unique by a digest of the pool's name)."""
    suffix = f"-{service_class.value}"
    base = _NOT_DNS.sub("-", pool.lower()).strip("-") or "pool"
    if base == pool and len(base) + len(suffix) <= _MAX_NAME:
        return base + suffix
    digest = hashlib.sha256(pool.encode()).hexdigest()[:8]
    room = _MAX_NAME - len(suffix) - len(digest) - 1
    return f"{base[:room].rstrip('-')}-{digest}{suffix}"
