"""What the gateway reports of each request once it has ended: one access-log line (JSON or
text) and the metrics of its tokens and timings."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.tenancy import Caller

if TYPE_CHECKING:
    from tokenpools.gateway.exchange import Exchange
    from tokenpools.gateway.history import History
    from tokenpools.gateway.metrics import GatewayMetrics

ACCESS = logging.getLogger("tokenpools.access")
LogFormat = Literal["text", "json"]


@dataclass(slots=True)
class RequestRecord:
    """One request as the access log and the metrics see it."""

    request_id: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int = 0  # 499: the client went away before an answer
    tenant: str | None = None
    credential: str | None = None  # a key's label, `jwt` or `header`: never the key
    subject: str | None = None  # a JWT's `sub`
    entitlement: str | None = None  # the one charged: the layer that admitted it
    pool: str | None = None
    model: str | None = None
    stream: bool = False
    decision: str | None = None  # admitted | rejected; None: refused before admission
    reason: str | None = None
    retry_after_s: float | None = None
    backend: str | None = None
    counted_prompt_tokens: int | None = None  # what admission reserved for (estimate or tokenizer)
    prompt_tokens: int | None = None  # the engine's count once it answered
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, from the engine's prefix cache
    cost_micros: int | None = None  # what it cost at its pool's prices (docs/budgets.md)
    evicted: bool = False
    ttft_s: float | None = None  # to the first streamed event, or to the whole answer
    duration_s: float = 0.0

    def identified(self, caller: Caller) -> None:
        self.tenant, self.credential = caller.tenant, caller.credential
        self.subject = caller.subject

    def decided(self, decision: Decision, entitlement: str) -> None:
        """`entitlement`: the one charged, or the layer a refusal counts on."""
        self.entitlement = entitlement
        if isinstance(decision, Admit):
            self.decision = "admitted"
        else:
            self.decision, self.reason = "rejected", decision.reason.value
            self.retry_after_s = decision.retry_after_s

    def __str__(self) -> str:  # the text access-log line
        tokens = f"{self.prompt_tokens or '-'}/{self.completion_tokens or '-'}"
        return (
            f"{self.request_id} {self.method} {self.path} {self.status} {self.tenant or '-'} "
            f"{self.credential or '-'} {self.entitlement or '-'} {self.decision or '-'} "
            f"{self.reason or '-'} "
            f"tokens={tokens} duration={self.duration_s * 1000:.1f}ms"
        )

    def exchanged(self, exchange: Exchange) -> None:
        usage = exchange.usage
        if usage is not None:
            self.prompt_tokens = usage.input_tokens
            self.completion_tokens = usage.output_tokens
            self.cached_tokens = usage.cached_tokens
            charge = exchange.admitted.charge  # computed once, where the lease was settled
            if charge is not None:
                self.cost_micros = int(charge.cost)
        self.evicted = exchange.admitted.evicted
        if exchange.first_token_at is not None:
            self.ttft_s = exchange.first_token_at - self.started


class RequestObserver:
    def __init__(self, metrics: GatewayMetrics, history: History, access_log: bool = True) -> None:
        self.metrics = metrics
        self.history = history
        self.access_log = access_log

    def request(self, record: RequestRecord) -> None:
        self.metrics.finished(record)
        if record.ttft_s is not None and record.entitlement is not None:
            self.history.first_token(record.entitlement, record.ttft_s)
        if self.access_log and ACCESS.isEnabledFor(logging.INFO):
            ACCESS.info("%s", record, extra={"access": record})  # formatted only if emitted


def _fields(record: RequestRecord) -> dict[str, Any]:
    out = {k: v for k, v in asdict(record).items() if v is not None and k != "started"}
    for key in ("ttft_s", "duration_s", "retry_after_s"):
        if key in out:
            out[key] = round(out[key], 6)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an access line carries the request's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        access = getattr(record, "access", None)
        if isinstance(access, RequestRecord):
            line.update(_fields(access))
        else:
            line["message"] = record.getMessage()
            if record.exc_info:
                line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"))


def setup_logging(fmt: LogFormat = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
