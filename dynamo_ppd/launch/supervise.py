"""Supervision of a running graph: restart a component that exits (as Kubernetes restarts a pod),
restart one on request (`Deployment.restart`, `dynamo-ppd ctl restart`), and start or retire one
on request (`Deployment.add_replica`, `Deployment.retire`: a scale-out, a scale-in).

Every start after start-up happens on the supervisor's one long-lived thread. That matters: the
children are started with PR_SET_PDEATHSIG (process.py), which Linux fires when the *thread* that
forked them exits, so a process started from a short-lived thread (an HTTP handler, a thread pool)
would be SIGTERMed as soon as that thread ends.

A restart reuses the process's argv, environment, ports and log file (opened for append); etcd and
NATS keep their data directories, like a pod with a volume. Automatic restarts back off
exponentially (0.5 s, 1 s, 2 s ... at most 8 s) and the backoff resets once a process has stayed up
for 30 s, a short version of Kubernetes' CrashLoopBackOff.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .process import ManagedProcess

BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
RESET_AFTER_S = 30.0


@dataclass
class RestartEvent:
    """One (re)start of a process; times are `time.monotonic()`."""

    label: str
    reason: str  # "exited" (supervised restart), "requested", "added" (scale-out) or "retired" (scale-in)
    exit_code: int | None
    exited_at: float
    started_at: float | None = None
    ready_at: float | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)  # set when ready

    def as_dict(self) -> dict:
        return {"label": self.label, "reason": self.reason, "exit_code": self.exit_code,
                "down_s": None if self.started_at is None else round(self.started_at - self.exited_at, 3),
                "ready_after_s": None if self.ready_at is None else round(self.ready_at - self.exited_at, 3)}


def backoff_s(consecutive: int) -> float:
    """Delay before the ``consecutive``-th restart in a row (1-based) of a process."""
    return min(MAX_BACKOFF_S, BACKOFF_S * 2 ** max(0, consecutive - 1))


@dataclass
class _State:
    consecutive: int = 0  # restarts in a row without staying up RESET_AFTER_S
    due: float | None = None  # when an automatic restart is scheduled
    event: RestartEvent | None = None  # the restart waiting for its process to be ready


def _stop(proc: ManagedProcess) -> int | None:
    """SIGTERM, then SIGKILL after the process's stop timeout (its grace period); its exit code."""
    proc.signal_group(signal.SIGTERM)
    if not proc.wait_stopped(time.monotonic() + proc.stop_timeout_s):
        proc.signal_group(signal.SIGKILL)
        proc.wait_stopped(time.monotonic() + 5)
    return proc.exit_code()


class Supervisor:
    """Watches ``processes()``; with ``auto_restart`` a process that exits is started again.

    ``processes`` is read on every pass, so processes added later are watched too."""

    def __init__(self, processes: Callable[[], list[ManagedProcess]], auto_restart: bool,
                 log: Callable[[str], None] = print, on_change: Callable[[], None] | None = None,
                 poll_s: float = 0.1):
        self._processes = processes
        self.auto_restart = auto_restart
        self._log = log
        self._on_change = on_change or (lambda: None)
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._requests: list[tuple[ManagedProcess, RestartEvent]] = []
        # Starts and retirements on request, each with what to do once it happened (the
        # deployment adds the process to its list, or drops it).
        self._changes: list[tuple[ManagedProcess, RestartEvent, Callable[[], None]]] = []
        self._states: dict[str, _State] = {}
        self._busy: set[str] = set()  # labels being restarted on request (down on purpose)
        self._halted = False
        self._exit = threading.Event()
        self.events: list[RestartEvent] = []
        self._thread = threading.Thread(target=self._run, name="dynamo-ppd-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def halt(self) -> None:
        """Restart nothing from now on (the graph is being stopped); the thread stays alive so the
        processes it started are not sent their parent-death signal before they are stopped."""
        with self._lock:
            self._halted = True
            pending = list(self._requests)
            self._requests.clear()
        for _, event in pending:
            event.done.set()

    def join(self) -> None:
        self.halt()
        self._exit.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def restarting(self, label: str) -> bool:
        """True while ``label`` is down on purpose or waiting for a scheduled restart."""
        with self._lock:
            state = self._states.get(label)
            return label in self._busy or (state is not None and state.due is not None)

    def restarts(self, label: str) -> int:
        return sum(1 for e in self.events if e.label == label and e.started_at is not None
                   and e.reason != "added")  # (a scale-out's first start is no restart)

    def request_restart(self, proc: ManagedProcess) -> RestartEvent:
        """Stop ``proc`` (SIGTERM, then SIGKILL after its stop timeout) and start it again, on the
        supervisor thread; the returned event's ``done`` is set once it is ready again."""
        event = RestartEvent(proc.label, "requested", None, time.monotonic())
        with self._lock:
            if self._halted:
                raise RuntimeError("the graph is stopping; nothing is restarted")
            self._busy.add(proc.label)
            self._requests.append((proc, event))
        return event

    def request_start(self, proc: ManagedProcess, started: Callable[[], None]) -> RestartEvent:
        """Start a new process (a scale-out) on the supervisor thread; ``started`` runs once it is
        (the deployment lists it: supervised from then on). The event's ``done`` is set once it is
        ready, or has exited before."""
        return self._change(proc, RestartEvent(proc.label, "added", None, time.monotonic()), started)

    def request_retire(self, proc: ManagedProcess, stopped: Callable[[], None]) -> RestartEvent:
        """Stop a process for good (a scale-in): SIGTERM, which a Dynamo component answers by
        leaving discovery at once and finishing what it serves (its graceful shutdown), SIGKILL
        after its stop timeout (the grace period); ``stopped`` runs then (the deployment drops it)
        and the event's ``done`` is set. Never restarted."""
        return self._change(proc, RestartEvent(proc.label, "retired", None, time.monotonic()), stopped)

    def _change(self, proc: ManagedProcess, event: RestartEvent, then: Callable[[], None]) -> RestartEvent:
        with self._lock:
            if self._halted:
                raise RuntimeError("the graph is stopping; nothing is started or retired")
            self._busy.add(proc.label)
            self._changes.append((proc, event, then))
        return event

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._exit.is_set():
            try:
                self._pass()
            except Exception as exc:  # noqa: BLE001 (the supervisor must outlive one bad pass)
                self._log(f"  supervisor: {type(exc).__name__}: {exc}")
            self._exit.wait(self._poll_s)

    def _pass(self) -> None:
        with self._lock:
            requests, self._requests = self._requests, []
            changes, self._changes = self._changes, []
            halted = self._halted
        for proc, event in requests:
            self._restart_requested(proc, event)
        for proc, event, then in changes:
            self._changed(proc, event, then)
        if halted:
            return
        now = time.monotonic()
        for proc in self._processes():
            state = self._states.setdefault(proc.label, _State())
            pending = state.event
            if pending is not None and pending.started_at is not None and pending.ready_at is None:
                self._check_ready(proc, state)
            if proc.label in self._busy:
                continue
            code = proc.exit_code()
            if code is None:
                if state.consecutive and proc.started_at and now - proc.started_at > RESET_AFTER_S:
                    state.consecutive = 0
                continue
            if not self.auto_restart:
                continue
            if state.due is None:
                state.consecutive += 1
                state.due = now + backoff_s(state.consecutive)
                state.event = RestartEvent(proc.label, "exited", code, now)
                self.events.append(state.event)
                self._log(f"  {proc.label} exited with code {code}; restart {state.consecutive} in a "
                          f"row in {state.due - now:.1f} s (see {proc.log_path})")
            elif now >= state.due:
                proc.start()
                state.due = None
                assert state.event is not None
                state.event.started_at = time.monotonic()
                self._on_change()

    def _restart_requested(self, proc: ManagedProcess, event: RestartEvent) -> None:
        state = self._states.setdefault(proc.label, _State())
        self.events.append(event)
        try:
            event.exit_code = _stop(proc)
            with self._lock:
                if self._halted:
                    event.done.set()
                    return
            proc.start()
            event.started_at = time.monotonic()
            state.due, state.event = None, event
            self._log(f"  {proc.label} restarted on request (was stopped with code {event.exit_code})")
            self._on_change()
        finally:
            with self._lock:
                self._busy.discard(proc.label)
            if event.started_at is None:
                event.done.set()

    def _changed(self, proc: ManagedProcess, event: RestartEvent, then: Callable[[], None]) -> None:
        self.events.append(event)
        try:
            if event.reason == "added":
                with self._lock:
                    if self._halted:
                        return
                proc.start()
                event.started_at = time.monotonic()
                self._states[proc.label] = _State(event=event)  # `_check_ready` sets it done
                then()
                self._log(f"  {proc.label} started (scale-out)")
            else:
                event.exit_code = _stop(proc)
                then()
                self._states.pop(proc.label, None)
                self._log(f"  {proc.label} retired (scale-in; exit code {event.exit_code})")
            self._on_change()
        finally:
            with self._lock:
                self._busy.discard(proc.label)
            if event.reason == "retired" or event.started_at is None:
                event.done.set()

    def _check_ready(self, proc: ManagedProcess, state: _State) -> None:
        event = state.event
        assert event is not None
        if proc.exit_code() is not None:
            event.done.set()  # died again before ready: the next restart gets its own event
            state.event = None
            return
        if proc.is_ready():
            event.ready_at = time.monotonic()
            event.done.set()
            self._log(f"  {proc.label} ready again {event.ready_at - event.exited_at:.1f} s after it "
                      "went down")
            self._on_change()
