"""Admission, for any host: one front door (front_door.py: `FrontDoor.identify` and `.enter`,
`Cleared` or `Stopped` out), the decision core on its store (driver.py), the requests in flight
each owned by one `Admitted` from admission to its one end, and the background work (ticks,
lease renewal, config and capacity changes). The gateway (HTTP, backends, streaming), the
ext_proc processor and the LiteLLM integration stand on it; it imports nothing from them."""

from tokenpools.admission.admitted import Admitted
from tokenpools.admission.front_door import Cleared, FrontDoor, Stopped
from tokenpools.admission.runtime import AdmissionRuntime

__all__ = ["AdmissionRuntime", "Admitted", "Cleared", "FrontDoor", "Stopped"]
