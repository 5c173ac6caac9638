"""TTFT the PPD router adds over Dynamo's frontend-native PD path, at low load:
`just bench-overhead` (`python -m dynamo_ppd.bench.overhead`).

Brings up, side by side, the `pd` graph (Dynamo's frontend does the prefill -> decode handoff
itself) and the `ppd` graph with the router forced to the same route (`--mode pd`), each on its
own simulated workers, NATS and etcd, and sends both the same sequence of single requests (one at
a time, fresh prompts, so nothing is cached), alternating: request i goes to one graph and then,
with the same prompt, to the other (which goes first alternates too). The difference in
client-measured TTFT is the router's cost: one more hop (frontend -> router -> workers) plus its
decision and bookkeeping.

Why side by side: measured one graph after the other, the pd graph's own median moved by 5 ms
between runs on this machine (49.7-55 ms), more than the figure. Interleaved, both graphs see the
same background load, and the added TTFT is a paired difference of medians with a 95% bootstrap
interval over the request pairs (`stats.paired_difference`). Both graphs idle between requests;
each request runs alone on the machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import httpx

from ..argtypes import positive_int
from ..experiment.stats import paired_difference
from ..launch import ServeOptions, start
from ..launch.process import free_port
from .compare import ppd_graph_with_mode

SYSTEMS = ("pd", "ppd")
LABELS = {"pd": "Dynamo frontend PD (pd graph)", "ppd": "frontend + PPD router, --mode pd"}


def _ttft_ms(client: httpx.Client, base_url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    sent = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
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


def _up(graph: str, workdir: Path):
    return start(ServeOptions(graph=_graph_file(graph, workdir), http_port=free_port(),
                              nats_port=free_port(), etcd_port=free_port(), run_dir=workdir / graph),
                 log=lambda _m: None)


def decision_mean_ms(metrics_text: str) -> tuple[float, int] | None:
    """The router's own mean decision time in ms and how many decisions it covers, from its
    Prometheus text (the ``ppd_decision_seconds`` histogram's sum and count); None: no decision."""
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "ppd_decision_seconds_sum":
                total += sample.value
            elif sample.name == "ppd_decision_seconds_count":
                count += sample.value
    return (total / count * 1e3, int(count)) if count else None


def _router_decisions(dep) -> tuple[float, int] | None:
    url = dep.metrics_urls.get("router")
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback)
            return decision_mean_ms(response.read().decode())
    except OSError:
        return None


def measure(requests: int, prompt_words: int, max_tokens: int, workdir: Path,
            gap_s: float = 0.05) -> tuple[dict[str, list[float]], tuple[float, int] | None]:
    """TTFT samples (ms) per system, request i of each system on the same prompt; and the PPD
    router's own mean decision time (ms, decisions), read off its metrics before it stops."""
    deps = {}
    try:
        for graph in SYSTEMS:
            sys.stderr.write(f"starting {graph} ...\n")
            deps[graph] = _up(graph, workdir)
        rng = random.Random(0)
        words = [f"w{n}" for n in range(2000)]
        samples: dict[str, list[float]] = {graph: [] for graph in SYSTEMS}
        with httpx.Client() as client:
            def ask(graph: str, prompt: str) -> float:
                dep = deps[graph]
                value = _ttft_ms(client, dep.base_url, dep.model_name, prompt, max_tokens)
                time.sleep(gap_s)  # low load: one request at a time, with gaps
                return value

            for _ in range(5):  # warm up connections and caches of the processes themselves
                prompt = " ".join(rng.choices(words, k=prompt_words))
                for graph in SYSTEMS:
                    ask(graph, prompt)
            for i in range(requests):
                prompt = " ".join(rng.choices(words, k=prompt_words))
                for graph in SYSTEMS if i % 2 == 0 else tuple(reversed(SYSTEMS)):
                    samples[graph].append(ask(graph, prompt))
                if (i + 1) % 20 == 0 or i + 1 == requests:
                    sys.stderr.write(f"  {i + 1}/{requests} request pairs\n")
        return samples, _router_decisions(deps["ppd"])
    finally:
        for dep in deps.values():
            dep.stop()


def render(samples: dict[str, list[float]], decisions: tuple[float, int] | None = None) -> str:
    out = [f"{'system':<34}{'n':>5}{'p50 ms':>9}{'p90 ms':>9}{'mean ms':>9}"]
    for graph in SYSTEMS:
        values = samples[graph]
        q = statistics.quantiles(values, n=10)
        out.append(f"{LABELS[graph]:<34}{len(values):>5}{statistics.median(values):>9.2f}{q[8]:>9.2f}"
                   f"{statistics.mean(values):>9.2f}")
    pairs = {graph: {f"r{i}": [v] for i, v in enumerate(samples[graph])} for graph in SYSTEMS}
    added = paired_difference(pairs["ppd"], pairs["pd"])
    if added is not None:
        out.append(f"router adds {added.value:+.2f} ms to median TTFT, 95% interval [{added.low:+.2f}, "
                   f"{added.high:+.2f}] over {added.conversations} request pairs")
    if decisions is not None:
        out.append(f"of which the router's decision (session lookup, residency, loads, policy): mean "
                   f"{decisions[0]:.3f} ms over {decisions[1]} decisions (its ppd_decision_seconds)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynamo_ppd.bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=positive_int, default=100,
                        help="timed requests per system (request pairs)")
    parser.add_argument("--prompt-words", type=positive_int, default=200,
                        help="words per prompt (fresh each)")
    parser.add_argument("--max-tokens", type=positive_int, default=4, help="output tokens per request")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ppd-overhead-") as tmp:
        samples, decisions = measure(args.requests, args.prompt_words, args.max_tokens, Path(tmp))
    print(render(samples, decisions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
