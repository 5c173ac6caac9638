"""Measuring live deployments: the multi-turn benchmark against Dynamo's own routers and the
request path's costs.

- `compare` (`dynamo-ppd bench compare`): each system's graph started and played a manifest over
  HTTP (`client`), with its simulated twin (`sizing`) and the route each request took (`routes`);
  `results` is its schema, table and plots, `cpu` the processes' CPU from /proc;
- `relay` (`python -m dynamo_ppd.bench.relay`): the relay router and the picker against a bare
  relay and Dynamo's frontend, CPU per token and the TTFT a callout adds; `overhead` the client's;
- `picker_path` (+ `_load`, `_report`; `dynamo-ppd bench picker`): the endpoint picker's own time
  per request, by stage, at fixed rates;
- `decisions`, `sessions`, `router_state`: the routing state's costs in process.

The workloads are manifests (`dynamo_ppd.workloads`, docs/manifest.md); the same manifest drives
the live benchmark and the virtual-clock simulator, so the two are compared on identical traffic.
"""
