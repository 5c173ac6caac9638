"""A local stand-in for an Envoy-based Gateway with the ext_proc filter set up as the Gateway API
Inference Extension sets it up, in front of Dynamo's OpenAI HTTP frontend: each request is shown
to an endpoint picker over Envoy's ext_proc protocol and forwarded where the picker says
(`python -m dynamo_ppd.gateway --help`). Without pickers it is a plain pass-through, so that
systems benchmarked behind it differ only by the callout.

Modules: `args` (config and command line), `http` (HTTP/1.1 framing), `headers` (Envoy's header
map and mutation rules, pure), `extproc` (the ext_proc client), `upstream` (pooled forwarding),
`proxy` (the server), `metrics`."""

from .args import GatewayConfig
from .proxy import Gateway, serve

__all__ = ["Gateway", "GatewayConfig", "serve"]
