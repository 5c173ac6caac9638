"""What every Dynamo component of ours does the same way: a runtime from the environment the
launcher (or the operator) sets, shut down on SIGTERM/SIGINT so the component deregisters at once
instead of lingering for its 30 s lease, a uvloop entry point with Dynamo's logging, and the stop
of a background task."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any


def create_runtime():
    """A DistributedRuntime for the running loop, configured from DYN_* (as Dynamo's own
    components read it), that shuts down on SIGTERM and SIGINT."""
    from dynamo.common.utils.runtime import create_runtime as dynamo_create_runtime

    runtime, loop = dynamo_create_runtime(os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                                          os.environ.get("DYN_REQUEST_PLANE", "tcp"),
                                          os.environ.get("DYN_EVENT_PLANE") or None)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.shutdown)
    return runtime


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a component's background ``task`` and wait for it to end (its clean-up runs)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def run_component(serve: Callable[[Any], Coroutine], config: Any) -> None:
    """Run ``serve(config)`` on uvloop with Dynamo's log format."""
    import uvloop
    from dynamo.runtime.logging import configure_dynamo_logging

    configure_dynamo_logging()
    uvloop.run(serve(config))
