"""TTFT the PPD router adds over Dynamo's frontend-native PD path, at low load:
`just bench-overhead` (`python -m dynamo_ppd.bench.overhead`).

Brings up, one after the other, the `pd` graph (Dynamo's frontend does the prefill -> decode
handoff itself) and the `ppd` graph with the router forced to the same route (`--mode pd`), both
on the same simulated workers, and sends the same sequence of single requests (one at a time,
fresh prompts, so nothing is cached) to each. The difference in client-measured TTFT is the
router's cost: one more hop (frontend -> router -> workers) plus its decision and bookkeeping.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from ..launch import ServeOptions, start
from ..launch.process import free_port
from .compare import ppd_graph_with_mode


def _ttft_ms(base_url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    sent = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return (time.perf_counter() - sent) * 1e3
    raise RuntimeError("no token came back")


def _graph_file(name: str, workdir: Path) -> str:
    """The bundled graph; for ppd, with the router's mode set to pd (the same route as `pd`)."""
    if name != "ppd":
        return name
    return ppd_graph_with_mode("pd", workdir)


def run(graph: str, requests: int, prompt_words: int, max_tokens: int, workdir: Path) -> list[float]:
    dep = start(ServeOptions(graph=_graph_file(graph, workdir), http_port=free_port(),
                             nats_port=free_port(), etcd_port=free_port(), run_dir=workdir / graph),
                log=lambda _m: None)
    try:
        rng = random.Random(0)
        words = [f"w{n}" for n in range(2000)]

        def prompt() -> str:
            return " ".join(rng.choices(words, k=prompt_words))

        for _ in range(5):  # warm up connections and caches of the processes themselves
            _ttft_ms(dep.base_url, dep.model_name, prompt(), max_tokens)
        samples = []
        for _ in range(requests):
            samples.append(_ttft_ms(dep.base_url, dep.model_name, prompt(), max_tokens))
            time.sleep(0.05)  # low load: one request at a time, with gaps
        return samples
    finally:
        dep.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="timed requests per system")
    parser.add_argument("--prompt-words", type=int, default=200, help="words per prompt (fresh each)")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="ppd-overhead-") as tmp:
        for graph in ("pd", "ppd"):
            print(f"measuring {graph} ...", flush=True)
            results[graph] = run(graph, args.requests, args.prompt_words, args.max_tokens, Path(tmp))
    print(f"\n{'system':<34}{'p50 ms':>9}{'p90 ms':>9}{'mean ms':>9}")
    labels = {"pd": "Dynamo frontend PD (pd graph)", "ppd": "frontend + PPD router, --mode pd"}
    for graph, label in labels.items():
        q = statistics.quantiles(results[graph], n=10)
        print(f"{label:<34}{statistics.median(results[graph]):>9.2f}{q[8]:>9.2f}"
              f"{statistics.mean(results[graph]):>9.2f}")
    added = statistics.median(results["ppd"]) - statistics.median(results["pd"])
    print(f"router adds {added:+.2f} ms to median TTFT")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
