"""Supervised graphs: a process that exits is started again; one process can be killed or restarted
(Python API and `dynamo-ppd ctl` through the control channel). Real processes throughout."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dynamo_ppd.chaos.client import play
from dynamo_ppd.launch.process import ManagedProcess, group_alive, stop_all
from dynamo_ppd.launch.supervise import Supervisor, backoff_s
from dynamo_ppd.workloads.manifest import Manifest, ManifestConversation, ManifestHeader, ManifestTurn


def sleeper(tmp_path: Path, label: str) -> ManagedProcess:
    return ManagedProcess(label, [sys.executable, "-c", "import time; time.sleep(120)"], {},
                          tmp_path / f"{label}.log")


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.mark.unit
def test_backoff_doubles_up_to_a_cap():
    assert [backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


@pytest.mark.e2e
def test_supervisor_restarts_a_killed_process_with_the_same_argv(tmp_path):
    procs = [sleeper(tmp_path, "a"), sleeper(tmp_path, "b")]
    for p in procs:
        p.start()
    sup = Supervisor(lambda: procs, auto_restart=True, log=lambda _m: None)
    sup.start()
    try:
        a, b = procs
        first_pid, argv = a.pid, list(a.argv)
        a.signal_group(signal.SIGKILL)
        wait_for(lambda: sup.restarts("a") == 1 and a.exit_code() is None and a.pid != first_pid)
        assert a.argv == argv and not group_alive(first_pid)
        (event,) = sup.events
        assert event.done.wait(5) and event.ready_at is not None
        assert event.exit_code == -signal.SIGKILL
        assert event.started_at - event.exited_at >= 0.45  # the first backoff (0.5 s)
        assert sup.restarts("b") == 0 and b.exit_code() is None

        # On request: stopped with SIGTERM, started again, ready.
        second_pid = a.pid
        requested = sup.request_restart(a)
        assert requested.done.wait(10) and requested.exit_code == -signal.SIGTERM
        assert a.pid != second_pid and a.exit_code() is None and sup.restarts("a") == 2

        # Halted (the graph is stopping): a process that exits stays down.
        sup.halt()
        b.signal_group(signal.SIGKILL)
        time.sleep(1.0)
        assert b.exit_code() is not None and sup.restarts("b") == 0
        with pytest.raises(RuntimeError):
            sup.request_restart(b)
    finally:
        stop_all(procs)
        sup.join()


@pytest.mark.e2e
def test_a_process_added_is_supervised_and_one_retired_stays_gone(tmp_path):
    """A scale-out's process starts on the supervisor's thread and is restarted like the rest if
    it dies; a scale-in's gets SIGTERM, leaves the list and is never started again."""
    procs = [sleeper(tmp_path, "a")]
    procs[0].start()
    sup = Supervisor(lambda: list(procs), auto_restart=True, log=lambda _m: None)
    sup.start()
    try:
        added = sleeper(tmp_path, "b")
        event = sup.request_start(added, lambda: procs.append(added))
        assert event.done.wait(10) and event.reason == "added" and event.ready_at is not None
        assert procs[-1] is added and added.exit_code() is None
        pid = added.pid
        added.signal_group(signal.SIGKILL)  # supervised like any other from now on
        wait_for(lambda: sup.restarts("b") == 1 and added.exit_code() is None and added.pid != pid)

        retired = procs[0]
        gone = sup.request_retire(retired, lambda: procs.remove(retired))
        assert gone.done.wait(10) and gone.reason == "retired"
        assert gone.exit_code == -signal.SIGTERM and retired not in procs
        time.sleep(1.0)  # past the first backoff: nothing starts it again
        assert retired.exit_code() is not None and sup.restarts("a") == 0
    finally:
        stop_all(procs + [p for p in (locals().get("retired"),) if p is not None])
        sup.join()


@pytest.mark.e2e
def test_unsupervised_processes_stay_down_but_restart_on_request(tmp_path):
    procs = [sleeper(tmp_path, "a")]
    procs[0].start()
    sup = Supervisor(lambda: procs, auto_restart=False, log=lambda _m: None)
    sup.start()
    try:
        event = sup.request_restart(procs[0])
        assert sup.restarting("a")  # serve must not take the planned stop for a crash
        assert event.done.wait(10) and procs[0].exit_code() is None
        procs[0].signal_group(signal.SIGKILL)
        time.sleep(1.0)
        assert procs[0].exit_code() is not None and not sup.restarting("a")
    finally:
        stop_all(procs)
        sup.join()


def ctl(run, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynamo_ppd", "ctl", "--run-dir", str(run.run_dir), *args],
                          capture_output=True, text=True, timeout=120)


def etcd_put_get(url: str, key: bytes, value: bytes | None = None) -> bytes | None:
    import aetcd

    from dynamo_ppd.launch.servers import etcd_host_port

    async def go():
        host, port = etcd_host_port(url)
        async with aetcd.Client(host=host, port=port, timeout=5) as client:
            if value is not None:
                await client.put(key, value)
            got = await client.get(key)
            return got.value if got else None
    return asyncio.run(go())


def chat_ok(base_url: str) -> bool:
    body = {"model": "llama-3.1-8b-sim", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.e2e
def test_serve_supervise_with_ctl_kill_and_restart(serve_run):
    run = serve_run("ppd-relay", "--supervise", "--replicas", "decode=2")
    record = run.wait_ready()
    assert record["supervise"] is True and record["control_url"].startswith("http://127.0.0.1:")
    pids = {p["label"]: p["pid"] for p in record["processes"]}

    # A SIGKILLed decode worker is started again; the graph keeps serving.
    killed = ctl(run, "kill", "decode-1")
    assert killed.returncode == 0 and f"pid {pids['decode-1']}" in killed.stdout, killed.stderr
    wait_for(lambda: {p["label"]: p for p in run.record()["processes"]}["decode-1"]["restarts"] == 1, 20)
    status = ctl(run, "status")
    assert status.returncode == 0
    line = next(x for x in status.stdout.splitlines() if x.startswith("decode-1 "))
    assert "alive" in line and "restarts 1" in line and str(pids["decode-1"]) not in line
    assert run.proc.poll() is None
    wait_for(lambda: chat_ok(run.base_url), 30)

    # A scale-out and a scale-in by hand: the new replica serves, the retired one is gone for good.
    added = ctl(run, "add", "decode")
    assert added.returncode == 0 and added.stdout.startswith("added decode-2: ready"), added.stderr
    retired = ctl(run, "retire", "decode-0")
    assert retired.returncode == 0 and retired.stdout.startswith("retired decode-0: gone"), retired.stderr
    labels = [line.split()[0] for line in ctl(run, "status").stdout.splitlines()]
    assert "decode-2" in labels and "decode-0" not in labels and "decode-1" in labels
    assert [p["label"] for p in run.record()["processes"] if p["label"].startswith("decode")] == \
        ["decode-1", "decode-2"]
    wait_for(lambda: chat_ok(run.base_url), 30)
    unknown = ctl(run, "add", "nope")
    assert unknown.returncode == 1 and "no component 'nope'" in unknown.stderr

    # etcd restarted on its data directory: what was written survives.
    etcd_put_get(record["etcd_url"], b"chaos-test/key", b"kept")
    restarted = ctl(run, "restart", "etcd")
    assert restarted.returncode == 0 and "restarted etcd" in restarted.stdout, restarted.stderr
    assert etcd_put_get(record["etcd_url"], b"chaos-test/key") == b"kept"
    wait_for(lambda: chat_ok(run.base_url), 30)

    # The chaos client sees a stream cut mid-answer: the frontend is killed under it.
    manifest = Manifest(ManifestHeader(workload="t"), [
        ManifestConversation(f"c{i}", 0.0, [ManifestTurn(4000, user_tokens=20)]) for i in range(3)])

    async def cut() -> list:
        t0 = time.monotonic()
        playing = asyncio.create_task(play(run.base_url, manifest, t0))
        await asyncio.sleep(2.0)  # the answers (4,000 tokens, ~30 s) are streaming
        # In a thread: the client must keep reading, or the whole answer could sit in the socket's
        # buffers before the kill lands.
        killed = await asyncio.to_thread(ctl, run, "kill", "frontend")
        assert killed.returncode == 0, killed.stderr
        return await playing, time.monotonic() - t0, killed.stdout

    records, at, said = asyncio.run(cut())
    assert len(records) == 3 and all(r.status in ("failed", "truncated") for r in records), \
        (at, said, [(r.status, r.sent_s, r.e2e_s, r.error) for r in records])
    assert ctl(run, "kill", "no-such").returncode == 1
    assert run.stop() == 0
    assert ctl(run, "status").returncode == 1  # stopped: no control channel any more
