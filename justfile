# dynamo-ppd tasks. Every recipe runs through `uv run`, so the project's environment is used.

# List the recipes.
default:
    @just --list

# `exec`: a SIGTERM to `just` then reaches the launcher, which stops every process. After a
# Ctrl-C just itself prints "error: interrupted by SIGINT" and exits 130, however cleanly the
# graph stopped (just reports any signal it saw while a recipe ran); `uv run dynamo-ppd serve`
# exits 0.

# Run a graph locally (default `ppd`: gateway, PPD endpoint picker, Dynamo frontend, 1P3D); Ctrl-C stops it.
serve graph="ppd" *args:
    exec uv run dynamo-ppd serve {{graph}} {{args}}

# Run the whole test suite, every tier (real NATS, etcd and Dynamo processes on loopback); CI runs this.
test *args:
    uv run pytest {{args}}

# The unit tier without its slow tests (in process, no servers, each under ~2 s; ~15 s in all): run it after every change.
test-fast *args:
    uv run pytest -m "unit and not slow" -q {{args}}

# Lint and type-check.
lint:
    uv run ruff check .
    uv run mypy dynamo_ppd

# Router decision latency, in process (p50/p99 over 100k decisions).
bench-decisions *args:
    uv run python -m dynamo_ppd.bench.decisions {{args}}

# TTFT the PPD router adds over Dynamo's frontend-native PD path, at low load.
bench-overhead *args:
    uv run python -m dynamo_ppd.bench.overhead {{args}}

# Multi-turn benchmark: `just bench compare --systems pd,cond-disagg,ppd --qps 1,4` (see --help).
bench *args:
    uv run dynamo-ppd bench {{args}}

# (Re)write the local model directory (tokenizer + Llama-3.1-8B-shaped config).
model-init *args:
    uv run dynamo-ppd model init {{args}}

# Both protocols: the paper's (paper-stack profile, beside the authors' H100 measurements) ->
# docs/interference-paper.{json,png}; the closed loop (default profile) -> docs/interference.{json,png}.

# Interference micro-benchmark (paper Fig. 2/7/8) on the engine model -> docs/interference*.{json,png}.
interference *args:
    uv run dynamo-ppd sim interference --protocol paper --profile h100-llama3.1-8b-vllm-paper --json docs/interference-paper.json --png docs/interference-paper.png {{args}}
    uv run dynamo-ppd sim interference --protocol closed-loop --json docs/interference.json --png docs/interference.png {{args}}

# Simulate a multi-turn workload on a virtual-clock cluster (see `dynamo-ppd sim run --help`).
sim *args:
    uv run dynamo-ppd sim run {{args}}

# Rebuild the PPD tables shipped for the default profile (1P3D, 2P2D, 3P1D) on the simulation.
tables:
    for config in 1p3d 2p2d 3p1d; do uv run dynamo-ppd table build --config $config --out dynamo_ppd/policy/tables/h100-llama3.1-8b-$config.json || exit 1; done

# The paper's Table 1, Table 3, Fig. 5 and Fig. 6 on the simulated H100 cluster -> docs/results.md.
reproduce *args:
    uv run python -m dynamo_ppd.paper.reproduce {{args}}

# Faults: decode/prefill SIGKILL, router/etcd/NATS restart, one per supervised graph, at 2 conv/s
# WildChat-like (see `dynamo-ppd chaos --help`).

# Chaos run: one fault per supervised graph -> docs/chaos.md, docs/chaos.json.
chaos *args:
    uv run dynamo-ppd chaos --out docs/chaos {{args}}

# Also router replicas and TTFT at low load (see `python -m dynamo_ppd.bench.relay --help`).

# CPU per relayed token: the PPD relay router, a bare pass-through relay, Dynamo's frontend-native PD.
bench-relay *args:
    uv run python -m dynamo_ppd.bench.relay {{args}}

# In process against real etcd and NATS (see `python -m dynamo_ppd.bench.router_state --help`).

# CPU the PPD router's own state costs: per conversation's session work, per KV-event message.
bench-router-state *args:
    uv run python -m dynamo_ppd.bench.router_state {{args}}

# The endpoint picker's request path alone, per stage and rate (see `dynamo-ppd bench picker --help`).
bench-picker *args:
    uv run dynamo-ppd bench picker {{args}}
