"""Virtual-clock simulation: the engine model of `dynamo_ppd.engine` driven by a discrete-event
loop instead of a wall clock.

Cluster runs, laid out as Vidur's simulator: `conversation` generates conversations (kept apart from
the cluster), `cluster` holds the workers, their KV links and the event loop, `assignment` has what
a router sees and answers, `routing` the built-in routers (`peers`: the peers' P/D policies), `run`
drives conversations through a cluster and `outcome` summarizes them. Pure: no I/O; the
`dynamo-ppd sim run` command line is `dynamo_ppd.cli.sim`, the interference micro-benchmark
`dynamo_ppd.paper.interference`.
"""

from .assignment import Assignment, DecodeLocal, Replica, RoutingError, SimRequestFeatures, ViaPrefill
from .cluster import Cluster, ClusterView, Router, parse_config
from .conversation import Conversation, Turn, synthetic_workload
from .routing import fraction_router, local_router, make_router, pd_router, replica_router
from .run import RequestRecord, SimResult, simulate

__all__ = ["Assignment", "Cluster", "ClusterView", "Conversation", "DecodeLocal", "Replica",
           "RequestRecord", "Router", "RoutingError", "SimRequestFeatures", "SimResult", "Turn", "ViaPrefill",
           "fraction_router", "local_router", "make_router", "parse_config", "pd_router", "replica_router",
           "simulate", "synthetic_workload"]
