"""The engine priority the front door writes into an admitted request's body: the class's
band negated (vLLM serves lower values first) on a pool whose engines schedule by priority,
and never the client's own."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway_setup import config_data
from tokenpools.admission.clearing import write_priority
from tokenpools.model.config import ConfigError, parse_config
from tokenpools.model.objectives import PRIORITY, engine_priority
from tokenpools.model.service_class import ServiceClass
from tokenpools.openai_api import CHAT, COMPLETIONS, EMBEDDINGS


def test_the_engine_priority_orders_the_classes_as_the_objectives_do() -> None:
    order = sorted(ServiceClass, key=engine_priority)  # vLLM: lowest value served first
    bands = sorted(ServiceClass, key=lambda c: -PRIORITY[c])
    assert order == bands
    assert engine_priority(ServiceClass.GUARANTEED) == -10
    assert engine_priority(ServiceClass.PREEMPTIBLE) == 20
    assert engine_priority(ServiceClass.ELASTIC) == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("service_class", list(ServiceClass))
def test_a_priority_pool_gets_the_class_priority_whatever_the_client_sent(
    path: str, service_class: ServiceClass
) -> None:
    for sent in ({}, {"priority": -1000}, {"priority": "high"}, {"priority": None}):
        body: dict[str, Any] = {"model": "m", **sent}
        assert write_priority(path, body, "priority", service_class) is True
        assert body["priority"] == engine_priority(service_class)
        assert type(body["priority"]) is int


def test_a_body_that_already_says_the_class_priority_is_not_rewritten() -> None:
    body = {"model": "m", "priority": 10}
    assert write_priority(CHAT, body, "priority", ServiceClass.SPOT) is False
    assert body == {"model": "m", "priority": 10}
    # 10.0 == 10 in Python, but vLLM wants an integer: rewritten as one
    body = {"model": "m", "priority": 10.0}
    assert write_priority(CHAT, body, "priority", ServiceClass.SPOT) is True
    assert type(body["priority"]) is int


@pytest.mark.parametrize("sent", [-1000, 0, 5, None, "x"])
def test_a_fcfs_pool_removes_the_clients_priority(sent: object) -> None:
    body: dict[str, Any] = {"model": "m", "priority": sent}
    assert write_priority(CHAT, body, "fcfs", ServiceClass.GUARANTEED) is True
    assert "priority" not in body
    untouched: dict[str, Any] = {"model": "m"}
    assert write_priority(CHAT, untouched, "fcfs", ServiceClass.GUARANTEED) is False
    assert untouched == {"model": "m"}


def test_other_paths_carry_no_priority() -> None:
    body: dict[str, Any] = {"model": "m", "input": "x", "priority": -5}
    assert write_priority(EMBEDDINGS, body, "priority", ServiceClass.GUARANTEED) is True
    assert "priority" not in body


def test_the_pool_says_how_its_engines_schedule() -> None:
    data = config_data("http://127.0.0.1:9")
    assert parse_config(data).pools["pool"].scheduling_policy == "fcfs"
    data["pools"][0]["schedulingPolicy"] = "priority"
    assert parse_config(data).pools["pool"].scheduling_policy == "priority"
    data["pools"][0]["schedulingPolicy"] = "lottery"
    with pytest.raises(ConfigError, match="schedulingPolicy"):
        parse_config(data)
