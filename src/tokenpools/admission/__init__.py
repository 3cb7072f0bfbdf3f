"""Admission, for any host: one front door (`AdmissionRuntime.clear`: an `AdmissionRequest` in,
`Cleared` or `Stopped` out; front_door.py), the decision core on its store (driver.py), the
requests in flight each owned by one `Admitted` from admission to its one end, and the
background work (ticks, lease renewal, config and capacity changes). The gateway (HTTP,
backends, streaming) and the LiteLLM integration stand on it; it imports nothing from either."""

from tokenpools.admission.admitted import Admitted
from tokenpools.admission.front_door import AdmissionRequest, Cleared, Stopped
from tokenpools.admission.runtime import AdmissionRuntime

__all__ = ["AdmissionRequest", "AdmissionRuntime", "Admitted", "Cleared", "Stopped"]
