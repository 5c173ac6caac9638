"""The endpoint picker's per-request work: an OpenAI request in, its route as headers out.

`Picker.pick` parses the body, tokenizes it as Dynamo's frontend will (`prompt.PromptTokenizer`),
checks the limits, plans the turn with the relay router's own state and planner
(`routing.state.Routing.plan_turn`: session, residency, loads, the policy), records the turn in
its session (write-behind: nothing on the path waits for etcd), and answers with the frontend to
send the request to, the headers that carry the route (`route.route_headers`) and the body with
the prompt's token ids in it, so the frontend does not tokenize it again (`_body_to_send`). It
does not need the answer's tokens: the next turn finds the history by the decode worker's KV
events (TensorRT-LLM stores a finished sequence's blocks) and the prompt, which repeats the
answer. It sees the answer's status when the gateway sends the response headers (`answered`): a
failed turn pinned to a prefill worker tells it that worker is gone. And it watches a share of the
follow-ups' answers (`watch`, `outcomes.AnswerWatch`: ``--observe-share``) for their TTFT and
TPOT, which the policy learns from as it does behind the relay router.

The loads this picker adds (``Routing.loads``, which placement ranks workers by, merged with the
workers' forward-pass reports) are charged when a turn is routed and released when the turn is
predicted to have ended (the decision's predicted TTFT + TPOT x expected output, on the wall
clock), since no end of stream reaches the picker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
from dynamo.llm.exceptions import InvalidArgument

from ..policy.decision import Route
from ..routing.planner import NoWorkers
from ..routing.state import Routing, Turn
from .budget import OverBudget, TokenizeBudget
from .chat_template import Unplaceable
from .frontends import Frontends
from .messages import MESSAGES_PATH
from .outcomes import DEFAULT_OBSERVE_SHARE, AnswerWatch
from .prompt import PromptError, PromptTokenizer
from .route import (
    AGENT_SESSION_HEADERS,
    CLIENT_ROUTING_HEADERS,
    route_headers,
    session_from_headers,
    without_client_pins,
)
from .stages import StageClock

log = logging.getLogger("dynamo_ppd.picker")

HOLD_FALLBACK_S = 10.0  # a turn's load is held this long when the policy predicted nothing
HOLD_MAX_S = 600.0


class Refusal(Exception):
    """The request is answered by the gateway with this status and message, never forwarded."""

    def __init__(self, status: int, message: str, kind: str, anthropic: bool = False):
        super().__init__(message)
        self.status = status
        self.kind = kind  # ppd_request_errors_total{kind}
        self.anthropic = anthropic  # a /v1/messages request: the error in Anthropic's shape

    def body(self) -> bytes:
        """The error body Dynamo's frontend writes for the request's API: OpenAI's shape, or for
        /v1/messages Anthropic's (anthropic.rs ``anthropic_error_response``)."""
        if self.anthropic:
            kind = "invalid_request_error" if self.status < 500 else "overloaded_error"
            return json.dumps({"type": "error", "error": {"type": kind, "message": str(self)}}).encode()
        error_type = "invalid_request_error" if self.status < 500 else "service_unavailable"
        return json.dumps({"error": {"message": str(self), "type": error_type,
                                     "code": self.status}}).encode()


@dataclass(frozen=True)
class Pick:
    """Where a request goes and how: the frontend endpoint (``ip:port``), the header mutation,
    and the body to send (None: the original bytes, unchanged)."""

    endpoint: str
    set_headers: dict[str, str]
    remove_headers: tuple[str, ...]
    body: bytes | None
    turn: Turn | None = field(default=None, compare=False)  # the plan (its workers), for the answer's status


class Picker:
    """The per-request handler around the shared routing state (see the module docstring)."""

    def __init__(self, routing: Routing, tokenizer: PromptTokenizer,
                 frontends: Frontends | Sequence[str], send_token_ids: bool = True,
                 observe_share: float = DEFAULT_OBSERVE_SHARE, rng: random.Random | None = None,
                 session_headers: Sequence[str] = AGENT_SESSION_HEADERS,
                 budget: TokenizeBudget | None = None):
        self.routing = routing
        self.budget = budget or TokenizeBudget()  # `budget`: the tokenization's deadline
        self.session_headers = tuple(session_headers)  # `route.session_from_headers`
        self.tokenizer = tokenizer
        self.send_token_ids = send_token_ids  # `_body_to_send`
        self.observe_share = observe_share  # `watch`
        self._draw = (rng or random.Random()).random
        self.frontends = frontends if isinstance(frontends, Frontends) else Frontends(frontends)
        routing.decode_chosen_downstream = True
        routing.prefill_bound_downstream = True

    def frontend(self, subset: Sequence[str] | None = None) -> str:
        """The frontend a request goes to (round robin; one of ``subset`` when the gateway names
        the endpoints allowed); `Refusal` 503 when there is none."""
        endpoint = self.frontends.next(subset)
        if endpoint is None:
            self.routing.metrics.errors.labels("no_frontends").inc()
            why = ("the gateway allowed no endpoint for this request" if subset is not None else
                   "the picker's --frontend names "
                   f"{', '.join(self.frontends.names) or 'none'} resolve to no address")
            raise Refusal(503, f"no Dynamo frontend to send the request to ({why})", "no_frontends")
        return endpoint

    async def pick(self, headers: Mapping[str, str], body: bytes, path: str,
                   subset: Sequence[str] | None = None, clock: StageClock | None = None) -> Pick:
        """Route one request; raises `Refusal` (4xx/5xx) for one that must not be forwarded.
        ``subset``: the endpoints the gateway allows (see `frontend`); ``clock``: laps each stage."""
        errors = self.routing.metrics.errors
        clock = clock or StageClock()
        anthropic = path.split("?", 1)[0].rstrip("/") == MESSAGES_PATH
        try:
            request = json.loads(body)
        except ValueError as exc:
            errors.labels("bad_request").inc()
            raise Refusal(400, f"the request body is not valid JSON: {exc}", "bad_request",
                          anthropic) from None
        if not isinstance(request, dict):
            errors.labels("bad_request").inc()
            raise Refusal(400, "the request body must be a JSON object", "bad_request", anthropic)
        clock.lap("parse")
        try:
            if len(body) < self.budget.offload_bytes:
                tokens = self.tokenizer.tokens(request, path, lap=clock.lap)
            else:
                tokens = await self.budget.run(len(body), lambda: self.tokenizer.tokens(request, path))
            clock.lap("tokenize")
        except PromptError as exc:
            errors.labels("bad_request").inc()
            raise Refusal(400, str(exc), "bad_request", anthropic) from None
        except (Unplaceable, OverBudget) as exc:  # served by the frontend, placed by Dynamo's own routing
            log.log(logging.INFO if isinstance(exc, OverBudget) else logging.DEBUG, "unrouted (%s): %s",
                    exc.reason, exc)
            return self._unrouted(request, subset, exc.reason)
        max_tokens = (request.get("max_completion_tokens") or request.get("max_tokens")
                      or request.get("max_output_tokens"))  # (the last: the Responses API's)
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            errors.labels("bad_request").inc()
            raise Refusal(400, f"max_tokens must be a positive integer, not {max_tokens!r}", "bad_request",
                          anthropic)
        too_big = self.routing.limits.check(len(tokens), max_tokens)
        if too_big:  # before any worker sees it
            errors.labels("too_large").inc()
            raise Refusal(400, too_big, "too_large", anthropic)
        endpoint = self.frontend(subset)  # before the turn is planned: a refusal records nothing
        session_id = session_from_headers(headers, self.session_headers)
        turn_request = {"token_ids": tokens, "stop_conditions": {"max_tokens": max_tokens},
                        "agent_context": {"session_id": session_id} if session_id else None}
        self.routing.rate.record(time.monotonic())
        try:
            turn = await self.routing.plan_turn(turn_request, tokens, lap=clock.lap)
            clock.lap("plan")
        except NoWorkers as exc:
            errors.labels("no_workers").inc()
            raise Refusal(503, str(exc), "no_workers") from None
        except InvalidArgument as exc:  # a session id over the limit (`sessions.check_session_id`)
            errors.labels("bad_request").inc()
            raise Refusal(400, str(exc), "bad_request") from None
        # An unbound turn names no session: the frontend may still bind it to a dead prefill worker.
        route = route_headers(turn.decision.route, turn.prefill, None if turn.unbound else turn.session_id)
        self._charge(turn, max_tokens)
        self.routing.record_routed(turn, tokens)
        new_body = self._body_to_send(body, request, tokens, path)
        clock.lap("record")
        return Pick(endpoint, route.set, route.remove, new_body, turn)

    def _unrouted(self, request: dict, subset: Sequence[str] | None, reason: str) -> Pick:
        """A request the frontend serves as it would without a picker (Dynamo's own routing)."""
        endpoint = self.frontend(subset)
        self.routing.metrics.unplaced.labels(reason).inc()
        # Unrouted, but not the client's to route either: its own pins go, as on any request.
        pinned = without_client_pins(request)
        return Pick(endpoint, {}, CLIENT_ROUTING_HEADERS, msgspec.json.encode(request) if pinned else None)

    def _body_to_send(self, body: bytes, request: dict, tokens: list[int], path: str) -> bytes | None:
        """The body the frontend gets: None (the client's bytes) or a new one, without a client's
        routing pins (`without_client_pins`) and, with ``send_token_ids``, carrying the picker's
        token ids as ``nvext.token_data``. Dynamo 1.6.1's preprocessor (``gather_tokens`` in
        lib/llm/src/preprocessor.rs, "[SIDECAR-SKIP-TOKENIZE] Found nvext.token_data") then uses
        them instead of tokenizing the prompt a second time, as it does for Dynamo's own EPP
        (deploy/inference-gateway, ``setTokenizedPrompt``); the chat template is still rendered
        there. A prompt given as token ids needs no tokenizing and is left alone."""
        pinned = without_client_pins(request)
        nvext = request.get("nvext")
        carries_ids = isinstance(nvext, dict) and "token_data" in nvext
        if not self.send_token_ids or carries_ids or not self.tokenizer.tokenized_text(request, path):
            return msgspec.json.encode(request) if pinned else None
        if pinned or "nvext" in request:  # (an explicit null too: a second key would be refused)
            request["nvext"] = {**(nvext or {}), "token_data": tokens}
            return msgspec.json.encode(request)
        # No nvext in the body: splice it in before the object's closing brace rather than encode
        # the whole request again (a 100K-token prompt is ~400 KB of text).
        end = body.rindex(b"}")
        return b"".join((body[:end], b',"nvext":{"token_data":', msgspec.json.encode(tokens), b"}}",
                         body[end + 1:]))

    def answered(self, pick: Pick, status: int | None) -> None:
        """The gateway reports the frontend's answer status for a routed request. A 5xx for a turn
        pinned to a prefill worker most likely means that worker is gone (Dynamo's frontend
        neither re-routes nor migrates a pinned prefill): it is left out of plans at once, for
        the time the relay router leaves out a worker that failed under it
        (`Routing.mark_unreachable`), rather than until discovery drops it (~20 s)."""
        turn = pick.turn
        if status is None or status < 500 or turn is None or turn.decision.route is not Route.VIA_PREFILL:
            return
        if turn.prefill is None:
            return
        log.warning("HTTP %d for a turn pinned to prefill worker %x: leaving it out of plans",
                    status, turn.prefill)
        self.routing.metrics.errors.labels("prefill_failed").inc()
        self.routing.mark_unreachable(turn.prefill)

    def watch(self, pick: Pick, status: int | None, content_type: str, picked_at: float,
              every_body: bool = False) -> AnswerWatch | None:
        """Whether to watch this answer for its TTFT and TPOT (`outcomes`): a streamed 200 to a
        follow-up the policy learns from, drawn with probability ``observe_share`` (0: none),
        or every one when the gateway streams every answer's body through the picker anyway
        (``every_body``: its response body mode is FULL_DUPLEX_STREAMED, GAIE's; the picker
        echoes each chunk whether it watches or not, and reading one costs ~2 us).
        Its watch, else None. ``picked_at``: when the route went out (``time.monotonic()``)."""
        turn = pick.turn
        if (status != 200 or turn is None or not self.observe_share or "event-stream" not in content_type
                or not self.routing.learns_from(turn)):
            return None
        if not every_body and self.observe_share < 1.0 and self._draw() >= self.observe_share:
            return None
        return AnswerWatch(self.routing, turn, picked_at)

    def _charge(self, turn: Turn, max_tokens: int | None) -> None:
        """Count the turn on its workers until it is predicted to end (see the module docstring)."""
        loads, decode, prompt = self.routing.loads, turn.decode, turn.prompt_tokens
        prefill = turn.prefill if turn.decision.route is Route.VIA_PREFILL else None
        outputs = max_tokens or self.routing.config.default_max_tokens
        loads.add_decode(decode, prompt, outputs)
        if prefill is not None:
            loads.prefill_tokens[prefill] += prompt
        prediction = (turn.decision.via_prefill if prefill is not None else turn.decision.local)
        if prediction is not None:
            hold_s = (prediction.ttft_s + prediction.tpot_s * outputs) / self.routing.config.speedup
            prefill_s = prediction.ttft_s / self.routing.config.speedup
        else:
            hold_s = prefill_s = HOLD_FALLBACK_S
        loop = asyncio.get_running_loop()

        def release_decode() -> None:
            loads.add_decode(decode, prompt, outputs, -1)

        loop.call_later(min(hold_s, HOLD_MAX_S), release_decode)
        if prefill is not None:
            def release_prefill(worker: int = prefill) -> None:
                loads.prefill_tokens[worker] = max(0, loads.prefill_tokens[worker] - prompt)

            loop.call_later(min(prefill_s, HOLD_MAX_S), release_prefill)
