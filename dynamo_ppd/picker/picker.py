"""The endpoint picker's per-request work: an OpenAI request in, its route as headers out.

`Picker.pick` parses the body, tokenizes it as Dynamo's frontend will (`prompt.PromptTokenizer`; a
large prompt on a worker thread within a deadline, `budget`), plans the turn with the relay
router's own state and planner (`routing.state.Routing.plan_turn`: session, residency, loads, the
policy), records the turn in its session (write-behind: nothing on the path waits for etcd), and
answers with the frontend to send the request to, the headers that carry the route
(`route.route_headers`) and the body with the prompt's token ids in it, so the frontend does not
tokenize it again (`_body_to_send`). It does not need the answer's tokens: the next turn finds the
history by the decode worker's KV events (TensorRT-LLM stores a finished sequence's blocks) and
the prompt, which repeats the answer. It sees the answer's status when the gateway sends the
response headers (`answered`): a failed turn pinned to a prefill worker tells it that worker is
gone. And it watches a share of the follow-ups' answers (`watch`, `outcomes.AnswerWatch`:
``--observe-share``) for their TTFT and TPOT, which the policy learns from as it does behind the
relay router.

What the picker cannot make a turn of goes to the frontend unrouted (`_unrouted`,
``ppd_requests_unplaced_total{reason}``): bad input the frontend refuses (its own status and
message reach the client: docs/errors.md), a model it does not serve, an API or a prompt the
picker does not mirror, a prompt too large to tokenize in time. It refuses (HTTP 503, `Refusal`)
only a request it has nowhere to send.

The loads this picker adds (``Routing.loads``, which placement ranks workers by, merged with the
workers' forward-pass reports) are charged when a turn is routed and released when the turn is
predicted to have ended (the decision's predicted TTFT + TPOT x expected output, on the wall
clock), since no end of stream reaches the picker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from ..apis import OTHER, Api, api_of
from ..policy.decision import Route
from ..routing.planner import NoWorkers
from ..routing.sessions import MAX_SESSION_ID_BYTES
from ..routing.state import Routing, Turn
from .budget import OverBudget, TokenizeBudget
from .chat_template import Unplaceable
from .frontends import Frontends
from .outcomes import DEFAULT_OBSERVE_SHARE, AnswerWatch
from .prompt import PromptError, PromptTokenizer
from .prompt_memo import DEFAULT_MEMO_MB, PromptMemos
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


# Dynamo 1.6.1's frontend refuses a larger max_tokens ("Max tokens must not exceed 1048576").
FRONTEND_MAX_TOKENS = 1 << 20
# Top-level fields the four APIs type alike, checked before the picker adds its token ids: the
# frontend's deserializer reports a wrong type at the end of the body it read, so a body the picker
# grew would get another position in the frontend's message than the client's own body does.
_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "seed", "top_k")
_NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p")


def plainly_typed(request: Mapping) -> bool:
    """Whether the fields every API types alike have their type (absent or null is fine)."""
    for key in _INTEGER_FIELDS:
        value = request.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return False
    for key in _NUMBER_FIELDS:
        value = request.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return False
    stream, options = request.get("stream"), request.get("stream_options")
    return (stream is None or isinstance(stream, bool)) and (options is None or isinstance(options, dict))


def _encode_ids(value: object) -> object:
    """msgspec's hook for the ids' array (`prompt_memo.Prompt.ids`)."""
    if isinstance(value, array):
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def valid_session_id(session_id: str | None) -> bool:
    """Whether a client's session id is one the frontend takes (`sessions.check_session_id`)."""
    return session_id is None or len(session_id.encode()) <= MAX_SESSION_ID_BYTES


class Refusal(Exception):
    """The request is answered by the gateway with this status and message, never forwarded. Only
    what the picker must answer itself is refused: nowhere to send the request (503). A request
    the frontend would refuse is sent there, unrouted, so the client gets the frontend's words."""

    def __init__(self, status: int, message: str, kind: str, api: Api = OTHER):
        super().__init__(message)
        self.status = status
        self.kind = kind  # ppd_request_errors_total{kind}
        self.api = api  # the request's API: the error's shape (`apis`)

    def body(self) -> bytes:
        return self.api.error_body(self.status, str(self))


@dataclass(frozen=True)
class Pick:
    """Where a request goes and how: the frontend endpoint (``ip:port``), the header mutation,
    and the body to send (None: the original bytes, unchanged)."""

    endpoint: str
    set_headers: dict[str, str]
    remove_headers: tuple[str, ...]
    body: bytes | None
    turn: Turn | None = field(default=None, compare=False)  # the plan (its workers), for the answer's status
    unplaced: str | None = None  # sent unrouted, and why (ppd_requests_unplaced_total's reason)


class Picker:
    """The per-request handler around the shared routing state (see the module docstring)."""

    def __init__(self, routing: Routing, tokenizer: PromptTokenizer,
                 frontends: Frontends | Sequence[str], send_token_ids: bool = True,
                 observe_share: float = DEFAULT_OBSERVE_SHARE, rng: random.Random | None = None,
                 session_headers: Sequence[str] = AGENT_SESSION_HEADERS,
                 budget: TokenizeBudget | None = None, served_models: Sequence[str] | None = None,
                 prompt_memo_mb: float = DEFAULT_MEMO_MB):
        self.routing = routing
        # The model names the frontend serves (None: not checked). A request naming none of them
        # is the frontend's to refuse, in its own words: it goes there unrouted, planning nothing.
        self.served_models = frozenset(served_models) if served_models else None
        self.budget = budget or TokenizeBudget()  # `budget`: the tokenization's deadline
        self.session_headers = tuple(session_headers)  # `route.session_from_headers`
        self.tokenizer = tokenizer
        # Each session's prompt work, kept for its next request (`prompt_memo`): what a request
        # costs grows with what is new in it, not with its context.
        self.prompts = PromptMemos(tokenizer, prompt_memo_mb)
        self.prompts.block_size = routing.config.block_size
        self.prompts.on_outcome = lambda outcome: routing.metrics.prompt_memo.labels(outcome).inc()
        self.send_token_ids = send_token_ids  # `_body_to_send`
        self.observe_share = observe_share  # `watch`
        self._draw = (rng or random.Random()).random
        self.frontends = frontends if isinstance(frontends, Frontends) else Frontends(frontends)
        routing.decode_chosen_downstream = True
        routing.prefill_bound_downstream = True

    def frontend(self, subset: Sequence[str] | None = None, api: Api = OTHER) -> str:
        """The frontend a request goes to (round robin; one of ``subset`` when the gateway names
        the endpoints allowed); `Refusal` 503 when there is none."""
        endpoint = self.frontends.next(subset)
        if endpoint is None:
            self.routing.metrics.errors.labels("no_frontends").inc()
            why = ("the gateway allowed no endpoint for this request" if subset is not None else
                   "the picker's --frontend names "
                   f"{', '.join(self.frontends.names) or 'none'} resolve to no address")
            raise Refusal(503, f"no Dynamo frontend to send the request to ({why})", "no_frontends", api)
        return endpoint

    async def pick(self, headers: Mapping[str, str], body: bytes, path: str,
                   subset: Sequence[str] | None = None, clock: StageClock | None = None) -> Pick:
        """Route one request; raises `Refusal` (503) for one that cannot be forwarded. A request
        the picker cannot make a turn of (bad JSON, a prompt the frontend refuses, limits it
        passes) goes to the frontend unrouted, which answers it in its own words
        (``ppd_requests_unplaced_total{reason="invalid"}``). ``subset``: the endpoints the
        gateway allows (see `frontend`); ``clock``: laps each stage."""
        clock = clock or StageClock()
        api = api_of(path)
        session_id = session_from_headers(headers, self.session_headers)
        try:  # past what an earlier request of the session (or with the same head) shares
            parsed = self.prompts.parse(body, path, session_id if valid_session_id(session_id) else None)
        except (ValueError, RecursionError):  # (RecursionError: nesting deeper than Python's stack)
            return self._unrouted(None, subset, "invalid", api)
        request = parsed.request
        if not isinstance(request, dict):
            return self._unrouted(None, subset, "invalid", api)
        if not plainly_typed(request):
            return self._unrouted(request, subset, "invalid", api)
        clock.lap("parse")
        if self.served_models is not None and request.get("model") not in self.served_models:
            return self._unrouted(request, subset, "model_not_served", api)
        try:
            if parsed.new_bytes < self.budget.offload_bytes:
                prompt = self.prompts.prompt(parsed)
            else:  # what is new in it is large: tokenized off the event loop, within the deadline
                prompt = await self.budget.run(parsed.new_bytes, lambda: self.prompts.prompt(parsed))
            clock.lap("tokenize")
        except PromptError as exc:
            log.debug("unrouted (invalid): %s", exc)
            return self._unrouted(request, subset, "invalid", api)
        except (Unplaceable, OverBudget) as exc:  # served by the frontend, placed by Dynamo's own routing
            log.log(logging.INFO if isinstance(exc, OverBudget) else logging.DEBUG, "unrouted (%s): %s",
                    exc.reason, exc)
            return self._unrouted(request, subset, exc.reason, api)
        tokens = prompt.ids
        max_tokens = (request.get("max_completion_tokens") or request.get("max_tokens")
                      or request.get("max_output_tokens"))  # (the last: the Responses API's)
        if ((max_tokens is not None and not 1 <= max_tokens <= FRONTEND_MAX_TOKENS)
                or self.routing.limits.prompt_refused(len(tokens)) or not valid_session_id(session_id)):
            return self._unrouted(request, subset, "invalid", api)
        endpoint = self.frontend(subset, api)  # before the turn is planned: a refusal records nothing
        turn_request = {"token_ids": tokens, "stop_conditions": {"max_tokens": max_tokens},
                        "agent_context": {"session_id": session_id} if session_id else None}
        self.routing.rate.record(time.monotonic())
        try:
            turn = await self.routing.plan_turn(turn_request, tokens, lap=clock.lap,
                                                known_hashes=prompt.known_hashes)
            clock.lap("plan")
        except NoWorkers as exc:
            self.routing.metrics.errors.labels("no_workers").inc()
            raise Refusal(503, str(exc), "no_workers", api) from None
        # An unbound turn names no session: the frontend may still bind it to a dead prefill worker.
        route = route_headers(turn.decision.route, turn.prefill, None if turn.unbound else turn.session_id)
        self._charge(turn, max_tokens)
        self.routing.record_routed(turn, tokens)
        self.prompts.remember(parsed, prompt, (turn.local_hashes, turn.chained or []))
        new_body = self._body_to_send(body, request, tokens, path, prompt.ids_json)
        clock.lap("record")
        return Pick(endpoint, route.set, route.remove, new_body, turn)

    def _unrouted(self, request: dict | None, subset: Sequence[str] | None, reason: str,
                  api: Api = OTHER) -> Pick:
        """A request the frontend serves, or refuses, as it would without a picker (Dynamo's own
        routing); ``request`` None: a body that is no JSON object, sent on as it came."""
        endpoint = self.frontend(subset, api)
        self.routing.metrics.unplaced.labels(reason).inc()
        # Unrouted, but not the client's to route either: its own pins go, as on any request.
        pinned = request is not None and without_client_pins(request)
        return Pick(endpoint, {}, CLIENT_ROUTING_HEADERS, msgspec.json.encode(request) if pinned else None,
                    unplaced=reason)

    def _body_to_send(self, body: bytes, request: dict, tokens: Sequence[int], path: str,
                      ids_json: Callable[[], bytes] | None = None) -> bytes | None:
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
            return msgspec.json.encode(request, enc_hook=_encode_ids)
        # No nvext in the body: splice it in before the object's closing brace rather than encode
        # the whole request again (a 100K-token prompt is ~400 KB of text).
        end = body.rindex(b"}")
        ids = ids_json() if ids_json is not None else msgspec.json.encode(tokens, enc_hook=_encode_ids)
        return b"".join((body[:end], b',"nvext":{"token_data":', ids, b"}}", body[end + 1:]))

    def answered(self, pick: Pick, status: int | None) -> None:
        """The gateway reports the frontend's answer status for a routed request. A 5xx for a turn
        pinned to a prefill worker most likely means that worker is gone (Dynamo's frontend
        neither re-routes nor migrates a pinned prefill): it is left out of plans at once, for
        the time the relay router leaves out a worker that failed under it
        (`Routing.mark_unreachable`), rather than until discovery drops it (~20 s)."""
        turn = pick.turn
        if turn is not None and status is not None and 400 <= status < 500:
            # Refused by the frontend for what the picker does not check (an orphan tool result):
            # the decision stands counted, the refusal beside it.
            self.routing.metrics.frontend_refusals.labels(str(status)).inc()
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
