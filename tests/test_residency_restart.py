"""Residency that recovers, end to end: a router SIGKILLed and started again in the middle of a
workload whose conversations share a long system prompt still knows what each decode worker holds
(rebuilt from the workers' local indexers), so follow-ups run decode-local."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_router import chat, decisions, deploy, metrics

from dynamo_ppd.launch.servers import live_dynamo_keys, revoke_leases

pytestmark = pytest.mark.e2e

SYSTEM = "You are the harbour master of a busy port; answer with care and precision. " * 40


def messages(user: str, history: list[dict] | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *(history or []), {"role": "user", "content": user}]


def restart_router(dep, timeout_s: float = 60) -> None:
    """SIGKILL the router (no clean deregistration, as a crash or an OOM kill), drop what it left in
    etcd (as its lease would expire), start the same command again and wait until it serves."""
    [router] = [p for p in dep.workers if p.label.startswith("router")]
    router.signal_group(signal.SIGKILL)
    assert router.wait_stopped(time.monotonic() + 10)
    left = [(key, lease) for key, lease in live_dynamo_keys(dep.endpoints.etcd_url, "ppd")
            if b"/router/" in key or b"router" in key.split(b"/")[-2:-1]]
    revoke_leases(dep.endpoints.etcd_url, left)
    router.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.is_ready() and _answers(dep):
            return
        time.sleep(0.2)
    raise AssertionError(f"the router did not come back:\n{router.log_tail(20)}")


def _answers(dep) -> bool:
    try:
        chat(dep, [{"role": "user", "content": "ping"}], None, max_tokens=2)
        return True
    except (AssertionError, httpx.HTTPError):
        return False


def first_turns(dep, names: list[str]) -> dict[str, list[dict]]:
    """Turn 1 of each conversation, all at once (so they spread over the decode workers)."""
    def one(name: str) -> tuple[str, list[dict]]:
        user = f"Conversation {name}: which ships came in today?"
        answer = chat(dep, messages(user), name)
        return name, [{"role": "user", "content": user}, {"role": "assistant", "content": answer["text"]}]
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(pool.map(one, names))


def follow_ups(dep, histories: dict[str, list[dict]]) -> None:
    with ThreadPoolExecutor(len(histories)) as pool:
        list(pool.map(lambda item: chat(dep, messages("And which ones left?", item[1]), item[0]),
                      histories.items()))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_follow_ups_stay_decode_local_across_a_router_restart(model_dir, tmp_path):
    # --mode local: every follow-up whose history its decode worker holds runs there, so the route
    # shows what the router knows (the ppd policy may also choose prefill for load).
    dep = deploy(tmp_path, model_dir, mode="local", decode=3)
    try:
        before = first_turns(dep, [f"old-{i}" for i in range(6)])  # every decode worker: the prompt
        time.sleep(0.5)
        restart_router(dep)
        time.sleep(1.5)  # the new router rebuilds each worker's view from its local indexer
        after = first_turns(dep, [f"new-{i}" for i in range(6)])
        time.sleep(0.5)
        follow_ups(dep, {**before, **after})
        # Counters of the new router process only: every follow-up, of the old conversations and of
        # those started after the restart, found its history on its decode worker.
        decided = {k: v for k, v in metrics(dep).items() if k.startswith("ppd_decisions_total")}
        assert decisions(dep, "decode_local", "follow_up") == 12, decided
        assert metrics(dep).get("ppd_residency_misses_total", 0) == 0, decided
        resyncs = sum(v for k, v in metrics(dep).items() if k.startswith("ppd_residency_resyncs_total"))
        assert resyncs >= 4  # one per worker at start (1 prefill, 3 decode), more on orphans
    finally:
        dep.stop()


@pytest.mark.slow
def test_a_decode_worker_without_kv_events_is_reported_once(model_dir, tmp_path):
    """A TensorRT-LLM decode worker started without --publish-kv-events: every follow-up goes through
    prefill; the router says so, once, in its log and in a metric."""
    dep = deploy(tmp_path, model_dir, decode=1, decode_args=("--no-publish-kv-events",),
                 router_args=("--kv-silent-after", "1"))
    try:
        history: list[dict] = []
        for turn in range(3):
            user = f"Question {turn}: which ships came in today?"
            answer = chat(dep, messages(user, history), "silent")
            history += [{"role": "user", "content": user}, {"role": "assistant", "content": answer["text"]}]
            time.sleep(1.0)
        assert decisions(dep, "decode_local", "follow_up") == 0  # nothing proves the history is there
        assert metrics(dep)["ppd_kv_silent_workers"] == 1
        [router] = [p for p in dep.workers if p.label.startswith("router")]
        warnings = [line for line in router.log_path.read_text().splitlines()
                    if "without publishing one KV event" in line]
        assert len(warnings) == 1, warnings
    finally:
        dep.stop()
