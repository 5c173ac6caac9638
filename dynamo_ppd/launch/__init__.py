"""Local launcher: graphs of processes (frontend, router, workers) on NATS and etcd, on loopback."""

from .graph import Graph, GraphError, load_graph
from .launcher import BadInput, Deployment, LaunchError, ServeOptions, serve, start

__all__ = ["BadInput", "Deployment", "Graph", "GraphError", "LaunchError", "ServeOptions",
           "load_graph", "serve", "start"]
