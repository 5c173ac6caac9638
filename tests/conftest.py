"""Shared fixtures: one model directory per test session, and `dynamo-ppd serve` runs as real
subprocesses on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamo_ppd import model
from dynamo_ppd.launch.process import free_port, group_alive


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    os.environ["DYNAMO_PPD_CACHE"] = str(cache)  # inherited by every `serve` subprocess
    return model.init_model_dir(cache / "models" / model.DEFAULT_MODEL_NAME)


class ServeRun:
    """`dynamo-ppd serve GRAPH` in a subprocess; `stop()` sends SIGTERM like Ctrl-C would."""

    def __init__(self, graph: str, run_dir: Path, *extra: str):
        self.http_port, self.nats_port, self.etcd_port = free_port(), free_port(), free_port()
        self.run_dir = run_dir
        self.argv = [sys.executable, "-m", "dynamo_ppd", "serve", graph, "--run-dir", str(run_dir),
                     "--http-port", str(self.http_port), "--nats-port", str(self.nats_port),
                     "--etcd-port", str(self.etcd_port), *extra]
        self.out = open(run_dir.parent / f"{run_dir.name}.out", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(self.argv, stdout=self.out, stderr=subprocess.STDOUT)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    def wait_ready(self, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                record = self.record()
                if record["state"] == "ready":
                    return record
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"serve not ready after {timeout} s:\n{self.output()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.close()

    def output(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return Path(self.out.name).read_text()

    def leftover_pids(self) -> list[int]:
        return [p["pid"] for p in self.record()["processes"] if p["pid"] and group_alive(p["pid"])]


@pytest.fixture
def serve_run(model_dir, tmp_path):
    runs: list[ServeRun] = []

    def launch(graph: str, *extra: str) -> ServeRun:
        run = ServeRun(graph, tmp_path / f"run{len(runs)}", *extra)
        runs.append(run)
        return run

    yield launch
    for run in runs:  # never leave a deployment behind, even when a test fails
        if run.proc.poll() is None:
            run.stop()
