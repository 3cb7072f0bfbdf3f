"""tokenpools as an Envoy external processor (ext_proc): one more host of the admission
runtime, beside the gateway and the LiteLLM integration, placed before the Gateway API
Inference Extension's endpoint picker (docs/envoy.md). It needs the `extproc` extra (gRPC and
Envoy's generated protos)."""

from tokenpools.extproc.processor import Processor
from tokenpools.extproc.server import Running, serve, start

__all__ = ["Processor", "Running", "serve", "start"]
