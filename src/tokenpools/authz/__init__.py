"""tokenpools as Envoy's external authorization service (ext_authz, HTTP mode) with Envoy's
gRPC access-log service for settlement: admission at one plain HTTP question per request, on
any Envoy that exposes HTTP ext_authz (a standalone Envoy, Envoy Gateway, Istio), at the cost
of what only ext_proc can do (docs/envoy.md). It needs the `extproc` extra (gRPC, protos)."""

from tokenpools.authz.server import Running, serve, start
from tokenpools.authz.service import Authorizer

__all__ = ["Authorizer", "Running", "serve", "start"]
