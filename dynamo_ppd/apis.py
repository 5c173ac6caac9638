"""The HTTP APIs a graph serves, one adapter each: which path, and the error body Dynamo 1.6.1's
frontend writes on it. Every component that answers a client itself (the endpoint picker's
refusals, the gateway's own 4xx and 5xx) takes the shape from here, by the request's path.

Shapes, as the 1.6.1 frontend answers (observed on the wheel, docs/errors.md):

- OpenAI's paths (chat completions, completions, responses, and any other):
  ``{"message": ..., "type": <the status's reason phrase>, "code": <status>}``, the frontend's
  ``ErrorMessage`` (lib/llm/src/http/service/openai.rs), e.g. ``"type": "Bad Request"``.
- Anthropic's ``/v1/messages`` (``--enable-anthropic-api``, lib/llm/src/http/service/anthropic.rs):
  ``{"type": "error", "error": {"type": <kind>, "message": ...}}``; the kind follows Anthropic's
  API reference by status (``invalid_request_error`` for a 4xx without a kind of its own,
  ``overloaded_error`` for 503 and 529, ``api_error`` for other 5xx).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"

# Anthropic's error types by status (docs.anthropic.com, "Errors").
_ANTHROPIC_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


@dataclass(frozen=True)
class Api:
    name: str  # "chat", "completions", "responses", "messages", or "other"
    path: str
    anthropic: bool = False

    def error_body(self, status: int, message: str) -> bytes:
        """The body the frontend would answer ``status`` with on this API."""
        if self.anthropic:
            kind = _ANTHROPIC_KINDS.get(status, "invalid_request_error" if status < 500 else "api_error")
            return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
        return json.dumps({"message": message, "type": _phrase(status), "code": status}).encode()


CHAT = Api("chat", CHAT_PATH)
COMPLETIONS = Api("completions", COMPLETIONS_PATH)
RESPONSES = Api("responses", RESPONSES_PATH)
MESSAGES = Api("messages", MESSAGES_PATH, anthropic=True)
OTHER = Api("other", "")
APIS = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
_BY_PATH = {api.path: api for api in APIS}


def normalized_path(target: str) -> str:
    """A request target's path: no query, no trailing slash."""
    return target.split("?", 1)[0].rstrip("/") or "/"


def api_of(target: str) -> Api:
    """The API a request target belongs to (`OTHER` for a path none of them serves)."""
    return _BY_PATH.get(normalized_path(target), OTHER)
