"""What a host reports of each request once it has ended, whichever host it is (the gateway,
the ext_proc processor): one access-log line (JSON or text) and the metrics of its tokens and
timings."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tokenpools.control.decisions import Admit, Decision
from tokenpools.control.tenancy import Caller

if TYPE_CHECKING:
    from tokenpools.control.metering import Charge
    from tokenpools.model.request import Usage

ACCESS = logging.getLogger("tokenpools.access")
# A client's own request id is kept when it is a plain token of sane length; else one is made.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id(given: str | None) -> str:
    """The id a request is logged and answered under: the client's `x-request-id`, if sane."""
    if given is not None and _REQUEST_ID.match(given):
        return given
    return f"req_{secrets.token_hex(12)}"


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
    # suspended and resumed (the gateway): how often, and the prompt tokens its continuations'
    # engines prefilled again (not from their prefix cache) — the engine work it cost
    suspensions: int | None = None
    suspended_s: float | None = None  # the time it spent suspended, in all
    recomputed_prompt_tokens: int | None = None
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

    def settled(self, usage: Usage | None, charge: Charge | None, evicted: bool) -> None:
        """How the admitted request ended: the engine's counts (None: released), what they
        cost (computed once, where the lease was settled), and whether the core evicted it."""
        if usage is not None:
            self.prompt_tokens = usage.input_tokens
            self.completion_tokens = usage.output_tokens
            self.cached_tokens = usage.cached_tokens
            if charge is not None:
                self.cost_micros = int(charge.cost)
        self.evicted = evicted

    def first_token(self, at: float | None) -> None:
        """When the first streamed event (or the whole answer) came, on `time.monotonic`."""
        if at is not None:
            self.ttft_s = at - self.started


class RequestObserver:
    """Each finished request to its listeners (the metrics first; the gateway's history) and
    into the access log."""

    def __init__(
        self,
        listeners: list[Callable[[RequestRecord], None]] | None = None,
        access_log: bool = True,
    ) -> None:
        self.listeners = listeners or []
        self.access_log = access_log

    def request(self, record: RequestRecord) -> None:
        for listener in self.listeners:
            listener(record)
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
