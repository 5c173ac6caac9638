"""The errors a client gets through a PPD graph against those Dynamo's frontend gives alone.

For every API (chat completions, completions, responses, Anthropic messages) and every bad input
of `bad_input.MUTATIONS` (but the two that only cost time: ``big_prompt``, ``many_messages``),
the same request goes to the graph's gateway and straight to its frontend; the answers' statuses
and bodies are compared (request ids in a body are masked). `DELIBERATE` lists where PPD answers
otherwise on purpose. `markdown` makes the table of docs/errors.md from the rows.

    uv run python -m dynamo_ppd.bench.error_parity --gateway http://127.0.0.1:8000 \\
        --frontend http://127.0.0.1:PORT --out docs/errors.md
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass

from .bad_input import HEADER_MUTATIONS, MUTATIONS, PATHS, _base

SLOW = ("big_prompt", "many_messages")  # what they test is time, not an answer: `bad_input` runs them
# Where the graph answers otherwise on purpose, and why.
DELIBERATE = {
    "nvext_pins": "the picker drops a client's routing pins (nvext backend_instance_id, annotations) "
                  "and routes the request; the frontend alone refuses a pin to a worker it does not know",
}
_IDS = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class Row:
    api: str
    case: str
    status: int  # through the graph
    body: str
    frontend_status: int  # the frontend alone
    frontend_body: str

    @property
    def equal(self) -> bool:
        return (self.status, self.body) == (self.frontend_status, self.frontend_body)

    @property
    def deliberate(self) -> str | None:
        return DELIBERATE.get(self.case)


def cases(model: str) -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(api, case, body, headers) for every API and bad input, the same every time."""
    out = []
    for name in sorted(MUTATIONS):
        if name in SLOW:
            continue
        for api in sorted(PATHS):
            rng = random.Random(1)
            body: dict | bytes = _base(api, model, rng)
            result = MUTATIONS[name](body, api, rng)  # type: ignore[arg-type]
            if result is not None:
                body = result
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {"content-type": "application/json", **HEADER_MUTATIONS.get(name, {})}
            out.append((api, name, payload, headers))
    return out


def _mask(text: str) -> str:
    return _IDS.sub("<id>", text)


def compare(gateway: str, frontend: str, model: str, timeout: float = 60) -> list[Row]:
    import httpx

    rows = []
    with httpx.Client(timeout=timeout) as client:
        for api, name, body, headers in cases(model):
            answers = []
            for url in (gateway, frontend):
                sent = {k: (v if v.isascii() else v.encode()) for k, v in headers.items()}
                r = client.post(url + PATHS[api], content=body, headers=sent)  # type: ignore[arg-type]
                answers.append((r.status_code, _mask(r.text) if r.status_code >= 400 else "(answered)"))
            rows.append(Row(api, name, answers[0][0], answers[0][1], answers[1][0], answers[1][1]))
    return rows


def _message(body: str) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body  # (the frontend answers some refusals in plain text)
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return body


def markdown(rows: list[Row]) -> str:
    lines = ["| API | bad input | status | the frontend's message | through PPD |", "|---|---|---|---|---|"]
    for r in rows:
        message = _message(r.frontend_body).replace("|", "\\|").replace("\n", " ")
        if len(message) > 110:
            message = message[:107] + "..."
        same = "same" if r.equal else (f"deliberate: {r.deliberate}" if r.deliberate else
                                       f"**differs**: {r.status} {_message(r.body)[:80]}")
        shown = str(r.frontend_status) if r.frontend_status >= 400 else f"{r.frontend_status} (served)"
        lines.append(f"| {r.api} | `{r.case}` | {shown} | {message or '(empty)'} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gateway", default="http://127.0.0.1:8000", help="the graph's gateway URL")
    p.add_argument("--frontend", required=True, help="the graph's Dynamo frontend URL (its --http-port)")
    p.add_argument("--model", default="llama-3.1-8b-sim", help="the served model")
    p.add_argument("--out", default=None, help="write the markdown table here (else print it)")
    a = p.parse_args(argv)
    import httpx
    try:
        rows = compare(a.gateway.rstrip("/"), a.frontend.rstrip("/"), a.model)
    except httpx.HTTPError as exc:
        print(f"error_parity: {exc}; are the gateway and the frontend up at those URLs?", file=sys.stderr)
        return 2
    table = markdown(rows)
    if a.out:
        with open(a.out, "w") as f:
            f.write(table)
    else:
        print(table)
    differ = [r for r in rows if not r.equal and not r.deliberate]
    print(f"{len(rows)} cases: {sum(r.equal for r in rows)} the same, "
          f"{sum(bool(not r.equal and r.deliberate) for r in rows)} deliberate, {len(differ)} differ",
          file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
