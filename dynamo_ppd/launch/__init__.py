"""Local launcher: graphs of processes (gateway, picker or relay router, frontend, workers) on NATS
and etcd, on loopback. A graph names the modules it starts (`python -m dynamo_ppd.picker`, ...);
the launcher imports none of them."""

from .graph import Graph, GraphError, load_graph
from .launcher import BadInput, Deployment, LaunchError, ServeOptions, serve, start

__all__ = ["BadInput", "Deployment", "Graph", "GraphError", "LaunchError", "ServeOptions",
           "load_graph", "serve", "start"]
