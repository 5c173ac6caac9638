"""One child process of a local deployment: started in its own session, logged to a file, stopped
with SIGTERM then SIGKILL on its whole process group (so nothing it spawned is left behind)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ReadySpec:
    http: str | None = None
    log: str | None = None
    tcp: tuple[str, int] | None = None
    timeout_s: float = 60.0


@dataclass
class ManagedProcess:
    label: str  # e.g. "decode-2" or "etcd"
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    ready: ReadySpec = field(default_factory=ReadySpec)
    stop_timeout_s: float = 10.0
    popen: subprocess.Popen | None = None
    started_at: float | None = None  # time.monotonic() of the latest start
    # Where the latest start's output begins in the log (appended across restarts): a log-ready
    # process is ready once this start has printed its line, not an earlier run.
    log_offset: int = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            # start_new_session: Ctrl-C in the terminal reaches only the launcher, which then stops
            # the children in order; and the child's pid is its process-group id for killpg.
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def exit_code(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def is_ready(self) -> bool:
        spec = self.ready
        if spec.tcp and not _tcp_open(*spec.tcp):
            return False
        if spec.http and not _http_ok(spec.http):
            return False
        if spec.log and not _log_matches(self.log_path, spec.log, self.log_offset):
            return False
        return True

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def wait_stopped(self, deadline: float) -> bool:
        """Wait until the leader exited and its group is empty; True if so before ``deadline``."""
        if self.popen is None:
            return True
        while True:
            leader_done = self.popen.poll() is not None
            if leader_done and not group_alive(self.popen.pid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(_strip_ansi(line) for line in text[-lines:])


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it if the launcher dies, even by SIGKILL,
    so a killed launcher leaves no orphans (they then deregister as on a normal stop)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_all(processes: list[ManagedProcess]) -> list[str]:
    """SIGTERM every group at once, wait each one's stop timeout, SIGKILL stragglers.

    Returns the labels that had to be killed."""
    for proc in processes:
        proc.signal_group(signal.SIGTERM)
    killed = []
    start = time.monotonic()
    for proc in processes:
        if not proc.wait_stopped(start + proc.stop_timeout_s):
            killed.append(proc.label)
            proc.signal_group(signal.SIGKILL)
            proc.wait_stopped(time.monotonic() + 5)
    return killed


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


# Ports this process handed out lately: the kernel may give the same free port to two calls in a
# row (the first one's socket is closed before the second binds), and a graph started with the
# same port for two servers fails at once (seen: the frontend's HTTP port given to NATS too).
_HANDED_OUT: deque[int] = deque(maxlen=1024)


def free_port(host: str = "127.0.0.1", below: int | None = None, avoid: set[int] | None = None) -> int:
    """A port free right now, and not one this process handed out lately. ``below``: Dynamo parses
    DYN_SYSTEM_PORT as an i16, so system ports must be under 32768, while the kernel's ephemeral
    range usually starts above it."""
    if below is None:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _HANDED_OUT and (avoid is None or port not in avoid):
                _HANDED_OUT.append(port)
                return port
        raise OSError("no free port found that was not handed out already")
    import random

    avoid = avoid or set()
    for _ in range(1000):
        port = random.randrange(20000, below)
        if port not in avoid and port not in _HANDED_OUT and not port_in_use(port, host):
            _HANDED_OUT.append(port)
            return port
    raise OSError(f"no free port found in 20000-{below}")


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback URL)
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _log_matches(path: Path, pattern: str, offset: int = 0) -> bool:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return False
    return re.search(pattern, _strip_ansi(text), re.MULTILINE) is not None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)
