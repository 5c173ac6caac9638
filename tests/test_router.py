"""The PPD router end to end: Dynamo's frontend -> router -> simulated TensorRT-LLM workers, with
real NATS and etcd, real HTTP requests."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from dynamo_ppd.launch import ServeOptions, start
from dynamo_ppd.launch.launcher import wait_ready
from dynamo_ppd.launch.process import free_port, stop_all
from dynamo_ppd.launch.servers import etcd_process
from dynamo_ppd.routing.sessions import decode as decode_session

pytestmark = pytest.mark.e2e

GRAPH = """
name: ppd-test
namespace: workers
components:
  - name: frontend
    command: ["{python}", "-m", "dynamo.frontend", "--http-port", "{http_port}", "--namespace", "ppd",
              "--router-mode", "round-robin", "--migration-limit", "3"]
    ready: {http: "http://127.0.0.1:{http_port}/health"}
  - name: prefill
    command: ["{python}", "-m", "dynamo_ppd.worker", "--model-path", "{model_dir}",
              "--disaggregation-mode", "prefill", "--endpoint", "dyn://workers.prefill.generate"]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
  - name: decode
    replicas: 3
    command: ["{python}", "-m", "dynamo_ppd.worker", "--model-path", "{model_dir}",
              "--disaggregation-mode", "decode", "--endpoint", "dyn://workers.backend.generate" DECODE_ARGS]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
  - name: router
    command: ["{python}", "-m", "dynamo_ppd.relay", "--model-path", "{model_dir}", "--namespace", "ppd",
              "--workers-namespace", "workers", "--nats-url", "{nats_url}",
              "--metrics-port", "{metrics_port}", ROUTER_ARGS]
    env: {DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS: '["generate"]'}
    ready: {http: "http://127.0.0.1:{system_port}/health"}
    metrics: "http://127.0.0.1:{metrics_port}/metrics"
"""


def deploy(tmp_path: Path, model_dir: Path, *, mode: str = "ppd", decode: int = 3, routers: int = 1,
           decode_args: tuple[str, ...] = (), sessions_etcd: str | None = None,
           router_args: tuple[str, ...] = ()):
    router_args = ("--mode", mode, "--etcd-url", sessions_etcd or "{etcd_url}", *router_args)
    text = (GRAPH.replace("ROUTER_ARGS", ", ".join(json.dumps(a) for a in router_args))
            .replace(" DECODE_ARGS", "".join(f", {json.dumps(a)}" for a in decode_args)))
    graph = tmp_path / "graph.yaml"
    graph.write_text(text)
    return start(ServeOptions(graph=str(graph), http_port=free_port(), nats_port=free_port(),
                              etcd_port=free_port(), model_dir=model_dir, run_dir=tmp_path / "run",
                              replicas={"decode": decode, "router": routers}),
                 log=lambda _m: None)


def chat(dep, messages: list[dict], session: str | None, max_tokens: int = 24) -> dict:
    headers = {"x-dynamo-session-id": session} if session else {}
    body = {"model": dep.model_name, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"{dep.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices", []):
                    text += choice.get("delta", {}).get("content") or ""
                usage = chunk.get("usage") or usage
    return {"text": text, "usage": usage}


def conversation(dep, turns: int, session: str | None = "conv-1", first: str | None = None,
                 between=None) -> list[dict]:
    messages = [{"role": "user", "content": first or "Tell me about the harbour and its ships. " * 20}]
    results = []
    for turn in range(turns):
        result = chat(dep, messages, session)
        results.append(result)
        messages += [{"role": "assistant", "content": result["text"]},
                     {"role": "user", "content": f"And then, part {turn + 2}?"}]
        time.sleep(0.3)  # KV events reach the router, the session record reaches etcd
        if between:
            between(turn + 1)
    return results


def metrics(dep, label: str = "router") -> dict[str, float]:
    out: dict[str, float] = {}
    urls = [url for name, url in dep.metrics_urls.items() if name.startswith(label)]
    for url in urls:
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith("ppd_") and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = out.get(name, 0.0) + float(value)
    return out


def decisions(dep, route: str, turn: str) -> float:
    return sum(v for k, v in metrics(dep).items()
               if k.startswith("ppd_decisions_total") and f'route="{route}"' in k and f'turn="{turn}"' in k)


def prefill_tokens_by_decode(dep, label: str = "decode") -> dict[str, int]:
    out = {}
    for proc in dep.workers:
        if proc.label.startswith(label):
            text = httpx.get(f"http://127.0.0.1:{proc.env['DYN_SYSTEM_PORT']}/metrics", timeout=10).text
            out[proc.label] = sum(int(float(line.split()[-1])) for line in text.splitlines()
                                  if line.startswith("dynamo_ppd_engine_prefill_tokens_total"))
    return out


def prefill_tokens_on(dep, label: str) -> int:
    """Prompt tokens the workers whose label starts with ``label`` computed so far."""
    return sum(prefill_tokens_by_decode(dep, label).values())


def requests_served(proc) -> float:
    """Requests a worker's generate endpoint received (Dynamo's own per-endpoint counter)."""
    text = httpx.get(f"http://127.0.0.1:{proc.env['DYN_SYSTEM_PORT']}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_requests_total") and 'dynamo_endpoint="generate"' in line)


def sessions_in(etcd_url: str) -> dict[str, object]:
    import aetcd

    from dynamo_ppd.launch.servers import etcd_host_port

    async def read():
        host, port = etcd_host_port(etcd_url)
        async with aetcd.Client(host=host, port=port, timeout=5) as client:
            found = await client.get_prefix(b"ppd/sessions/")
            return {kv.key.decode(): decode_session(kv.value) for kv in found}
    return asyncio.run(read())


@pytest.fixture(scope="module")
def ppd(model_dir, tmp_path_factory):
    dep = deploy(tmp_path_factory.mktemp("ppd"), model_dir)
    yield dep
    dep.stop()


def test_follow_ups_run_decode_local_on_the_conversation_decode_worker(ppd):
    before = prefill_tokens_by_decode(ppd)
    results = conversation(ppd, 4, session="four-turns")
    for previous, result in zip(results, results[1:], strict=False):
        history = previous["usage"]["prompt_tokens"] + previous["usage"]["completion_tokens"]
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * history
    assert decisions(ppd, "via_prefill", "first") == 1
    assert decisions(ppd, "decode_local", "follow_up") == 3
    # Only one decode worker computed anything: the conversation's, and only the appends.
    charged = {k: v - before[k] for k, v in prefill_tokens_by_decode(ppd).items() if v != before[k]}
    assert len(charged) == 1
    appended = sum(r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
                   for r in results[1:])
    assert sum(charged.values()) == appended
    [record] = [r for r in sessions_in(ppd.endpoints.etcd_url).values() if r.session_id == "four-turns"]
    assert record.turn == 4 and record.decode_worker is not None


def test_sessions_stick_without_a_header_by_prefix(ppd):
    # Found as follow-ups of their session (the route is the ppd policy's, which depends on load).
    before = sum(decisions(ppd, route, "follow_up") for route in ("decode_local", "via_prefill"))
    first = "A different story, about mountains and rivers. " * 15
    results = conversation(ppd, 3, session=None, first=first)
    assert sum(decisions(ppd, route, "follow_up") for route in ("decode_local", "via_prefill")) == before + 2
    [record] = [r for r in sessions_in(ppd.endpoints.etcd_url).values()
                if r.session_id.startswith("auto-") and r.context_tokens == sum(
                    results[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens"))]
    assert record.turn == 3


def test_bad_requests_get_4xx_with_a_message_and_nothing_breaks(ppd):
    url = f"{ppd.base_url}/v1/chat/completions"
    unknown = httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404 and "Model not found" in unknown.text
    malformed = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert 400 <= malformed.status_code < 500 and malformed.text
    no_messages = httpx.post(url, json={"model": ppd.model_name})
    assert 400 <= no_messages.status_code < 500 and "messages" in no_messages.text
    decode_before, prefill_before = prefill_tokens_by_decode(ppd), prefill_tokens_on(ppd, "prefill")
    spoofed = httpx.post(url, json={"model": ppd.model_name, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "hello " * 200}],
                                    "nvext": {"annotations": ["x-bypass-remote-prefill"]}})
    assert spoofed.status_code == 200
    # The client's bypass annotation is dropped, not obeyed: the prefill worker computed the
    # prompt, no decode worker computed any of it.
    prompt_tokens = spoofed.json()["usage"]["prompt_tokens"]
    assert prefill_tokens_on(ppd, "prefill") - prefill_before >= prompt_tokens - 32
    assert prefill_tokens_by_decode(ppd) == decode_before
    assert chat(ppd, [{"role": "user", "content": "still fine?"}], "after-errors")["usage"]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "local_follow_ups"), [("pd", 0), ("local", 2)])
def test_static_modes(model_dir, tmp_path, mode, local_follow_ups):
    dep = deploy(tmp_path, model_dir, mode=mode, decode=2)
    try:
        conversation(dep, 3, session=f"{mode}-session")
        assert decisions(dep, "decode_local", "follow_up") == local_follow_ups
        assert decisions(dep, "via_prefill", "follow_up") == 2 - local_follow_ups
    finally:
        dep.stop()


@pytest.mark.slow
def test_evicted_history_goes_through_prefill(model_dir, tmp_path):
    dep = deploy(tmp_path, model_dir, mode="local", decode=1, decode_args=("--kv-capacity-blocks", "80"))
    try:
        def crowd_out(turn: int) -> None:
            if turn == 1:  # other conversations on the only decode worker evict this one's blocks
                for i in range(3):
                    chat(dep, [{"role": "user", "content": f"Unrelated story {i} about deserts. " * 60}],
                         f"other-{i}", max_tokens=4)
                time.sleep(0.3)

        conversation(dep, 2, session="evicted", between=crowd_out)
        m = metrics(dep)
        assert m["ppd_residency_misses_total"] == 1
        assert decisions(dep, "via_prefill", "follow_up") == 1
    finally:
        dep.stop()


@pytest.mark.slow
def test_dead_decode_worker_rehomes_the_next_turn(model_dir, tmp_path):
    dep = deploy(tmp_path, model_dir, mode="local", decode=2)
    try:
        survivor: dict = {}  # the other decode worker, and how many requests it had served

        def kill_session_decode(turn: int) -> None:
            if turn != 1:
                return
            record = next(r for r in sessions_in(dep.endpoints.etcd_url).values() if r.session_id == "rehome")
            assert record.decode_worker is not None
            # The session's decode worker is the one that received the transfer: find it by its
            # instance id in etcd and kill it hard (no deregistration).
            victim = next(p for p in dep.workers if p.label.startswith("decode")
                          and f"as instance {record.decode_worker:x}" in _log(p))
            other = next(p for p in dep.workers if p.label.startswith("decode") and p is not victim)
            survivor.update(proc=other, served=requests_served(other))
            victim.signal_group(signal.SIGKILL)

        results = conversation(dep, 3, session="rehome", between=kill_session_decode)
        assert all(r["usage"]["completion_tokens"] == 24 for r in results)
        assert metrics(dep)["ppd_rehomes_total"] >= 1
        # Turns 2 and 3 ran on the survivor (it held nothing of the conversation before).
        assert requests_served(survivor["proc"]) - survivor["served"] == 2
    finally:
        dep.stop()


def _log(proc) -> str:
    """A worker's log (its start-up line names its instance id)."""
    return Path(proc.log_path).read_text(errors="replace")


@pytest.mark.slow
def test_two_router_replicas_keep_a_conversation_on_one_decode_worker(model_dir, tmp_path):
    dep = deploy(tmp_path, model_dir, mode="local", decode=3, routers=2)
    try:
        conversation(dep, 4, session="two-routers")
        per_router = [metrics_one(url) for url in dep.metrics_urls.values()]
        assert all(m.get("decisions", 0) >= 1 for m in per_router)  # the frontend alternated
        assert decisions(dep, "decode_local", "follow_up") == 3  # the session was found each time
        charged = [v for v in prefill_tokens_by_decode(dep).values() if v]
        assert len(charged) == 1
    finally:
        dep.stop()


def metrics_one(url: str) -> dict[str, float]:
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("ppd_decisions_total"):
            total += float(line.rsplit(" ", 1)[1])
    return {"decisions": total}


@pytest.mark.slow
def test_etcd_outage_routing_continues_and_sessions_resync(model_dir, tmp_path):
    data = tmp_path / "sessions-etcd"
    port = free_port()

    def sessions_etcd():
        proc = etcd_process(port, data, tmp_path / "sessions-etcd.log")
        proc.start()
        wait_ready([proc], log=lambda _message: None)  # LaunchError if it exits or is not up in 20 s
        return proc

    etcd = sessions_etcd()
    url = f"http://127.0.0.1:{port}"
    dep = deploy(tmp_path, model_dir, mode="local", decode=2, sessions_etcd=url)
    try:
        def outage(turn: int) -> None:
            if turn == 1:
                stop_all([etcd])
                time.sleep(1.5)  # the router notices

        results = conversation(dep, 3, session="outage", between=outage)
        assert all(r["usage"]["completion_tokens"] == 24 for r in results)
        assert metrics(dep)["ppd_etcd_up"] == 0
        assert decisions(dep, "decode_local", "follow_up") == 2  # still routed from the local cache
        etcd = sessions_etcd()  # back, with its data
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            stored = {r.session_id: r for r in sessions_in(url).values()}
            if stored.get("outage") and stored["outage"].turn == 3:
                break
            time.sleep(0.3)
        assert stored["outage"].turn == 3  # the turns routed during the outage were written back
        assert metrics(dep)["ppd_etcd_up"] == 1
    finally:
        dep.stop()
        stop_all([etcd])


@pytest.mark.slow
def test_live_table_build_drives_the_router_forced_routes(model_dir, tmp_path):
    from dynamo_ppd.policy.grid import ContextClass, GridSpec, WorkloadClass
    from dynamo_ppd.policy.table import Weights, validate
    from dynamo_ppd.tables.live import build_live_table

    dep = deploy(tmp_path, model_dir, mode="ppd", decode=2, router_args=("--allow-forced-route",))
    try:
        grid = GridSpec(context_classes=[ContextClass("large", None, 1024)],
                        workload_classes=[WorkloadClass("in64-out16", 64, 16)], qps_levels=[4.0])
        table = build_live_table(dep.base_url, "1P2D", Weights(), grid=grid, seconds_per_cell=3,
                                 progress=False)
        validate(table)
        [cell] = table.cells
        for m in (cell.via_prefill, cell.decode_local):
            assert m.requests > 0 and m.success_rate == 1.0 and m.follow_up_ttft_s < 1.0
        forced = {k: v for k, v in metrics(dep).items()
                  if k.startswith("ppd_decisions_total") and 'reason="forced"' in k}
        for route, m in (("decode_local", cell.decode_local), ("via_prefill", cell.via_prefill)):
            assert sum(v for k, v in forced.items() if f'route="{route}"' in k) == m.requests / 2
    finally:
        dep.stop()


def test_forced_route_is_ignored_without_the_flag(ppd):
    before = decisions(ppd, "via_prefill", "follow_up")
    messages = [{"role": "user", "content": "A story about forced routes. " * 20}]
    first = chat(ppd, messages, "no-forcing")
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "more"}]
    time.sleep(0.3)
    body = {"model": ppd.model_name, "messages": messages, "max_tokens": 4,
            "nvext": {"annotations": ["x-ppd-route:via_prefill"]}}
    response = httpx.post(f"{ppd.base_url}/v1/chat/completions", json=body,
                          headers={"x-dynamo-session-id": "no-forcing"}, timeout=30)
    assert response.status_code == 200
    assert decisions(ppd, "via_prefill", "follow_up") == before  # the router decided, not the client


def test_the_old_module_path_still_starts_the_relay_router():
    """Deployments written before the move run `python -m dynamo_ppd.router`: the shim reaches the
    relay router's own command line (its --help names the new path), and a bad flag fails as it."""
    import subprocess
    import sys

    for module in ("dynamo_ppd.router", "dynamo_ppd.relay"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert "usage: python -m dynamo_ppd.relay" in done.stdout and "--weights" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "dynamo_ppd.router", "--mode", "nonsense"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice: 'nonsense'" in bad.stderr
