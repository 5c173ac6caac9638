"""The multi-turn benchmark.

One file format, the manifest (`manifest.py`, described in docs/manifest.md), says what
conversations arrive when and what each turn sends and asks for; the workload generators
(`workloads.py`) write manifests for the paper's experiments and for ShareGPT- and WildChat-like
traffic. The same manifest drives the live benchmark over HTTP and the virtual-clock simulator
(`manifest.to_sim`), so the two are compared on identical traffic.
"""
