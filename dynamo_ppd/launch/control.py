"""The control channel of a running graph: a loopback HTTP port (``control_url`` in run.json) through
which another process (`dynamo-ppd ctl`) lists, kills or restarts one component, or adds or retires
one replica (a scale-out, a scale-in).

    GET  /status                          -> {"processes": [{label, pid, alive, restarts, ...}]}
    POST /kill     {"label": L, "signal": "KILL"}   -> {"label", "pid", "signal"}
    POST /restart  {"label": L, "timeout_s": 60}   -> the restart event (down_s, ready_after_s)
    POST /add      {"component": C, "timeout_s": 90} -> {"label", "ready_after_s"}
    POST /retire   {"label": L, "timeout_s": 90}   -> {"label", "exit_code", "gone_after_s"}

Answers are JSON; an unknown label is 404 with the known ones in the message. Only 127.0.0.1 is
bound: whoever can reach it can already signal our processes.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

from .supervise import RestartEvent


class ControlError(Exception):
    """The control channel answered with an error, or cannot be reached; one line."""


def parse_signal(name: str | int) -> signal.Signals:
    """``KILL``, ``SIGKILL``, ``kill`` or ``9`` -> signal.SIGKILL."""
    text = str(name).strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    try:
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (e.g. KILL, TERM, INT, 9)") from None


class Controlled(Protocol):
    """What the channel drives: a running graph (`launcher.Deployment`), declared here so the
    channel needs nothing from the launcher that starts it."""

    def status(self) -> list[dict]: ...

    def kill(self, label: str, sig: int = ...) -> int: ...

    def restart(self, label: str, wait: bool = True, timeout_s: float = 60.0) -> RestartEvent: ...

    def add_replica(self, component: str, wait: bool = True, timeout_s: float = 90.0
                    ) -> tuple[str, RestartEvent]: ...

    def retire(self, label: str, wait: bool = True, timeout_s: float = 90.0) -> RestartEvent: ...


class ControlServer:
    def __init__(self, deployment: Controlled, host: str = "127.0.0.1"):
        dep = deployment

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:  # the launcher's output is for the user
                pass

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if self.path.rstrip("/") == "/status":
                    self._answer(200, {"processes": dep.status()})
                else:
                    self._answer(404, {"error": f"no {self.path}; try /status"})

            def do_POST(self) -> None:  # noqa: N802
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}")
                    label = str(body.get("label", ""))
                    if self.path == "/kill":
                        sig = parse_signal(body.get("signal", "KILL"))
                        pid = dep.kill(label, sig)
                        self._answer(200, {"label": label, "pid": pid, "signal": sig.name})
                    elif self.path == "/restart":
                        event = dep.restart(label, timeout_s=float(body.get("timeout_s", 60)))
                        self._answer(200, event.as_dict())
                    elif self.path == "/add":
                        added, event = dep.add_replica(str(body.get("component", "")),
                                                       timeout_s=float(body.get("timeout_s", 90)))
                        ready = None if event.ready_at is None else round(event.ready_at - event.exited_at, 3)
                        self._answer(200, {"label": added, "ready_after_s": ready})
                    elif self.path == "/retire":
                        started = time.monotonic()
                        event = dep.retire(label, timeout_s=float(body.get("timeout_s", 90)))
                        self._answer(200, {"label": label, "exit_code": event.exit_code,
                                           "gone_after_s": round(time.monotonic() - started, 3)})
                    else:
                        self._answer(404, {"error": f"no {self.path}; POST /kill, /restart, /add or /retire"})
                except KeyError as exc:
                    self._answer(404, {"error": str(exc.args[0])})
                except (ValueError, RuntimeError, TimeoutError) as exc:
                    self._answer(400, {"error": str(exc)})

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="dynamo-ppd-control",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- the client side (dynamo-ppd ctl) -------------------------------------------------------------


def control_url(run_dir: Path) -> str:
    path = Path(run_dir) / "run.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ControlError(f"cannot read {path}: {exc} (is --run-dir the serve run's directory?)") from exc
    if record.get("state") == "stopped":
        raise ControlError(f"the graph of {run_dir} is stopped")
    url = record.get("control_url")
    if not url:
        raise ControlError(f"{path} has no control_url (started by an older dynamo-ppd?)")
    return str(url)


def call(url: str, path: str, body: dict | None = None, timeout_s: float = 90) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (loopback)
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", str(exc))
        except ValueError:
            message = str(exc)
        raise ControlError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ControlError(f"control channel {url} unreachable: {exc} "
                           "(is the graph still running?)") from None
