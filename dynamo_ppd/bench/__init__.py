"""The multi-turn benchmark and the experiments: measuring live deployments and the simulation.

The workloads it plays are manifests (`dynamo_ppd.workloads`, described in docs/manifest.md); the
same manifest drives the live benchmark over HTTP (`client.py`, `compare.py`) and the
virtual-clock simulator, so the two are compared on identical traffic.
"""
