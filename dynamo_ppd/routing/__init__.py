"""The routing state both shells share: one planner, many shells.

The relay router (`dynamo_ppd.relay`) and the endpoint picker (`dynamo_ppd.picker`) each wrap the
same `state.Routing`. It holds what a PPD router knows between turns and plans each turn:

- `state`: `Routing` (the state and `plan_turn`) and `Turn` (a planned turn);
- `planner`: the pure planning step (the policy's decision and the placement, from views);
- `sessions`: the etcd-backed session table (write-behind, leases, the watch);
- `residency` + `kv_sync` + `kv_events`: which blocks each worker holds, from its KV events over
  NATS (applied on a thread of their own), rebuilt by Dynamo's indexers after a silence;
- `load_reports`: the workers' forward-pass metrics; `rate_share`: the request rate shared across
  replicas; `limits`: context window and per-worker KV capacity from the model cards;
- `args` (`RoutingConfig`, the flags both shells take), `metrics` (`ppd_router_*`), `start`
  (a shell's policy and the state's start-up).

A feature of routing lives here, never in a shell. Nothing here imports a shell.
"""
