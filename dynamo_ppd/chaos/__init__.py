"""Chaos harness: a supervised graph under a multi-turn workload, one fault injected per run."""
