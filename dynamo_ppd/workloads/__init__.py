"""Workloads: what conversations arrive when, and what each turn sends (pure: no I/O but files).

One file format, the manifest (`manifest.py`, described in docs/manifest.md), says what
conversations arrive when and what each turn sends and asks for; the generators
(`generators.py`) write manifests for the paper's experiments and for ShareGPT- and WildChat-like
traffic. The same manifest drives the live benchmark over HTTP (`dynamo_ppd.bench`) and the
virtual-clock simulator (`manifest.to_sim`), so the two are compared on identical traffic. It sits
below both, beside the simulator, because the table grid and the simulated policies need the
paper's workloads too.
"""
