"""A stand-in `kubectl` for `deploy/smoke.sh k8s` over a local `dynamo-ppd serve` run: the graph's
processes play the release's pods (prefill -> pod/ppd-prefill, decode-1 -> pod/ppd-decode-1),
as the chart labels them.
It answers only the calls the smoke script makes:

    kubectl -n NS get gateway NAME -o jsonpath=...          -> 127.0.0.1 (GATEWAY_PORT: the graph's port)
    kubectl -n NS get pods ... -l app.kubernetes.io/name=dynamo-ppd-ROLE,...  -o name
    kubectl -n NS exec POD -c main -- python3 -c CODE URL   -> CODE run here, URL's port made the
        process's own (a worker's Dynamo system port for 9090, the picker's --metrics-port for 28808)

Run directory: $FAKE_KUBECTL_RUN_DIR (its run.json). Anything else exits 2, so the smoke script's
calls are pinned down by its test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path


def processes() -> dict[str, dict]:
    record = json.loads((Path(os.environ["FAKE_KUBECTL_RUN_DIR"]) / "run.json").read_text())
    return {p["label"]: p for p in record["processes"]}


def pod_name(label: str) -> str:
    return f"pod/ppd-{label}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["-n"]:
        argv = argv[2:]
    if argv[:2] == ["get", "gateway"]:
        print("127.0.0.1", end="")
        return 0
    if argv[:2] == ["get", "pods"]:
        selector = argv[argv.index("-l") + 1]
        role = re.search(r"app\.kubernetes\.io/name=dynamo-ppd-([a-z]+)", selector).group(1)
        for label, p in processes().items():
            if re.fullmatch(rf"{role}(-\d+)?", label) and p["pid"]:
                print(pod_name(label))
        return 0
    if argv[:1] == ["exec"] and "--" in argv:
        label = argv[1].removeprefix("pod/ppd-")
        command = argv[argv.index("--") + 1:]
        if command[:2] != ["python3", "-c"]:
            return 2
        p = processes()[label]
        port = p["system_port"] if not label.startswith("picker") else \
            int(p["argv"][p["argv"].index("--metrics-port") + 1])
        url = re.sub(r":\d+/", f":{port}/", command[3])
        return subprocess.run([sys.executable, "-c", command[2], url]).returncode
    print(f"fake kubectl: unexpected call {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
