"""Command line of the endpoint picker (`python -m dynamo_ppd.picker`): the routing
flags both shells take (`routing.args`: mode, weights, table, sessions, residency; one planner, two
shells) plus where the
picker serves ext_proc and which Dynamo frontends it names as destinations."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..argtypes import fraction
from ..routing.args import RoutingConfig, build_parser, config_from
from .budget import DEFAULT_DEADLINE_S
from .frontends import split_endpoint
from .outcomes import DEFAULT_OBSERVE_SHARE
from .prompt_memo import DEFAULT_MEMO_MB
from .route import AGENT_SESSION_HEADERS


@dataclass(frozen=True)
class PickerConfig:
    grpc_host: str
    grpc_port: int  # Envoy ext_proc (and gRPC health, unless health_port is set)
    health_port: int  # 0: health on grpc_port only
    frontends: tuple[str, ...]  # Dynamo frontends, ip:port or name:port (`frontends.Frontends`)
    frontend_refresh_s: float = 5.0  # names are resolved again this often
    secure_serving: bool = False  # ext_proc over TLS (`tls`); health_port stays plaintext
    cert_path: str | None = None  # tls.crt/tls.key; None: a self-signed certificate
    timings: bool = False  # each route carries the picker's own time per stage (dynamic metadata)
    send_token_ids: bool = True  # the body carries the picker's token ids (nvext.token_data)
    observe_share: float = DEFAULT_OBSERVE_SHARE  # follow-ups' answers watched for TTFT and TPOT
    session_headers: tuple[str, ...] = AGENT_SESSION_HEADERS  # a conversation's id, first present wins
    strip_anthropic_preamble: bool = True  # as the frontend's --strip-anthropic-preamble
    deadline_ms: float = DEFAULT_DEADLINE_S * 1e3  # a prompt's tokenization; over it: unrouted (`budget`)
    fast_tokenizer: bool = True  # fastokens for the text between added tokens, where it is exact
    prompt_memo_mb: float = DEFAULT_MEMO_MB  # sessions' prompt work kept for their next request


def _endpoint_list(text: str) -> tuple[str, ...]:
    endpoints = tuple(e.strip() for e in text.split(",") if e.strip())
    for endpoint in endpoints:
        try:
            split_endpoint(endpoint)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if not endpoints:
        raise argparse.ArgumentTypeError("give at least one frontend as ip:port or name:port")
    return endpoints


def _header_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    bad = [n for n in names if not n.isascii() or not all(c.isalnum() or c in "-_" for c in n)]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"give header names separated by commas (letters, digits, '-' "
                                         f"and '_'), not {text!r}")
    return names


def build_picker_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "python -m dynamo_ppd.picker"
    p.description = ("PPD endpoint picker: an Envoy ext_proc server (the Gateway API Inference "
                     "Extension's endpoint-picker protocol) in front of Dynamo's OpenAI frontend. "
                     "Per request it tokenizes the prompt, plans the turn as the PPD router does "
                     "and answers with the headers that pin the frontend's route; it relays no "
                     "token.")
    # Behind the picker the workers are the frontend's own (Dynamo's default namespace).
    p.set_defaults(namespace="dynamo", workers_namespace="dynamo")
    g = p.add_argument_group("endpoint picker")
    g.add_argument("--grpc-host", default="127.0.0.1",
                   help="address the ext_proc gRPC server binds (0.0.0.0 in a pod)")
    g.add_argument("--grpc-port", type=int, default=9002,
                   help="ext_proc gRPC port (GAIE's default 9002); gRPC health is served here too")
    g.add_argument("--health-port", type=int, default=0,
                   help="also serve gRPC health on this port (GAIE's default 9003; 0: off)")
    g.add_argument("--frontend", type=_endpoint_list, default=("127.0.0.1:8000",),
                   help="Dynamo frontend(s) named as the request's destination (round robin): "
                   "ip:port[,ip:port...], or name:port, resolved to every address it has and "
                   "again every --frontend-refresh seconds (on Kubernetes, a headless Service over "
                   "the frontend pods, the InferencePool's endpoints)")
    g.add_argument("--frontend-refresh", type=float, default=5.0,
                   help="seconds between resolutions of the --frontend names")
    g.add_argument("--secure-serving", action="store_true",
                   help="serve ext_proc over TLS, as GAIE's endpoint picker does by default (the "
                   "gateways' stock settings expect it); gRPC health on --health-port stays "
                   "plaintext for the kubelet's probes")
    g.add_argument("--cert-path", default=None,
                   help="with --secure-serving: a directory with tls.crt and tls.key (a mounted "
                   "kubernetes.io/tls Secret); default: a self-signed certificate made at start")
    g.add_argument("--token-ids", dest="send_token_ids", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="send the prompt's token ids to the frontend in the body's "
                   "nvext.token_data, so Dynamo's frontend does not tokenize the prompt a second "
                   "time (as Dynamo's own EPP does); --no-token-ids forwards the client's body as is")
    g.add_argument("--observe-share", type=fraction, default=DEFAULT_OBSERVE_SHARE,
                   help="share of the follow-ups' streamed answers the picker watches for their TTFT "
                   "and TPOT, which the policy learns from (online correction, "
                   "ppd_ttft_prediction_ratio, ppd_outcomes_observed_total), as the relay router "
                   "does for every answer. A watched answer's body streams through the picker (its "
                   "reply to the response headers asks the gateway for it with mode_override, "
                   "honoured where the gateway sets allow_mode_override): a gRPC message each way "
                   "per chunk, ~200 us of the picker's CPU per token watched. 0: watch none; 1: "
                   "every one. A gateway that streams every response body through the picker anyway "
                   "(FULL_DUPLEX_STREAMED, as GAIE's do) has every follow-up watched unless this is 0")
    g.add_argument("--session-headers", type=_header_list, default=AGENT_SESSION_HEADERS,
                   help="request headers that name a conversation, the first one present wins; a "
                   "request with none is recognised by its prompt's prefix. Default: the ones Dynamo "
                   "1.6.1's frontend reads, in its order: x-dynamo-session-id (any client), "
                   "x-claude-code-agent-id and x-claude-code-session-id (Claude Code: a subagent's "
                   "own id, else the session's), thread-id (Codex), x-session-id (opencode)")
    g.add_argument("--strip-anthropic-preamble", action=argparse.BooleanOptionalAction, default=True,
                   help="as the frontend's flag of that name (on by default there too): /v1/messages' "
                   "system prompt loses Claude Code's x-anthropic-billing-header line before it is "
                   "tokenized. Set it as the frontend's is, or follow-ups are placed by the wrong prefix")
    g.add_argument("--deadline-ms", type=float, default=DEFAULT_DEADLINE_S * 1e3,
                   help="the most time one request's tokenization may take on the picker's path. A "
                   "large prompt is tokenized on a worker thread while other requests are answered; "
                   "one that does not finish in time, or is predicted not to from the throughput "
                   "measured, goes to the frontend unrouted (ppd_requests_unplaced_total"
                   "{reason=\"over_deadline\"|\"predicted_over_deadline\"}), which serves or refuses "
                   "it as it would without a picker. Keep it well under the gateway's ext_proc message "
                   "timeout, so one large prompt never makes the gateway drop the picker; 0: no bound")
    g.add_argument("--fast-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="encode prompts with fastokens (10-25x faster than tokenizers here) where it "
                   "gives the tokenizer's own ids on a set of probes checked at start, else with "
                   "tokenizers, as Dynamo's frontend does; the log says which")
    g.add_argument("--prompt-memo-mb", type=float, default=DEFAULT_MEMO_MB, metavar="MB",
                   help="memory for what each session's last request computed (its body, converted "
                   "messages, prompt text, token ids, block hashes), so that its next request parses, "
                   "tokenizes and hashes only what it adds; least recently used dropped first "
                   "(ppd_prompt_memo_total says what each request reused); 0: off "
                   f"(default {DEFAULT_MEMO_MB})")
    g.add_argument("--timings", action="store_true",
                   help="add the picker's own time for each request, per stage, to the route's "
                   "dynamic metadata (namespace ppd.picker, microseconds): for the request-path "
                   "benchmark (dynamo-ppd bench picker) and gateway access logs")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[RoutingConfig, PickerConfig]:
    parser = build_picker_parser()
    a = parser.parse_args(argv)
    if not a.frontend_refresh > 0:
        parser.error(f"--frontend-refresh {a.frontend_refresh} must be > 0 seconds")
    for name in ("grpc_port", "health_port"):
        port = getattr(a, name)
        if not 0 <= port < 65536 or (name == "grpc_port" and port == 0):
            parser.error(f"--{name.replace('_', '-')} {port} is not a port (1-65535)")
    if a.mode == "replica" or a.replica_component:
        parser.error("the picker routes P/D deployments; aggregated workers (replica mode) are "
                     "served by Dynamo's own KV router with no picker")
    if not a.deadline_ms >= 0:
        parser.error(f"--deadline-ms {a.deadline_ms:g} must not be negative (0: no bound)")
    if not a.prompt_memo_mb >= 0:
        parser.error(f"--prompt-memo-mb {a.prompt_memo_mb:g} must not be negative (0: off)")
    if a.cert_path and not a.secure_serving:
        parser.error("--cert-path is for --secure-serving; add it, or drop --cert-path")
    return config_from(parser, a), PickerConfig(a.grpc_host, a.grpc_port, a.health_port, a.frontend,
                                                a.frontend_refresh, a.secure_serving, a.cert_path,
                                                a.timings, a.send_token_ids, a.observe_share,
                                                a.session_headers, a.strip_anthropic_preamble,
                                                a.deadline_ms, a.fast_tokenizer, a.prompt_memo_mb)
