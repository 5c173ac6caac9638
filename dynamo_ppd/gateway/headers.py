"""A request's headers as Envoy holds them while its ext_proc filter runs, and the changes an
endpoint picker may make to them (pure: protobuf messages in, header lists out; no I/O).

- `envoy_headers`: the header map Envoy's HTTP connection manager builds from an HTTP/1.1
  request: the pseudo-headers ``:authority`` (from Host), ``:path``, ``:method``, ``:scheme``,
  then the client's headers lower-cased, minus this hop's connection fields, plus the
  ``x-forwarded-proto`` and ``x-request-id`` the connection manager adds.
- `apply_header_mutation`: Envoy's `MutationUtils::applyHeaderMutations`
  (source/extensions/filters/http/ext_proc/mutation_utils.cc): removals first, then each
  HeaderValueOption: with ``append_action`` left at its default (APPEND_IF_EXISTS_OR_ADD) the
  ``append`` BoolValue decides and defaults to false, i.e. overwrite (ext_proc picks false on
  purpose, unlike the router); ADD_IF_ABSENT, OVERWRITE_IF_EXISTS and OVERWRITE_IF_EXISTS_OR_ADD
  do what they say. Without ``mutation_rules`` Envoy refuses changes to ``host``,
  ``:authority``, ``:scheme``, ``:method`` and ``x-envoy-*`` (ext_proc.proto, ``mutation_rules``)
  and never removes a pseudo-header: those are skipped here too.
- `destination`: the endpoint the Gateway API Inference Extension's EPP picked (endpoint picker
  protocol, docs/proposals/004-endpoint-picker-protocol): the ``x-gateway-destination-endpoint``
  header, else the same key in the ``envoy.lb`` dynamic metadata namespace.
"""

from __future__ import annotations

import logging
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from .http import Headers, RequestHead, first

log = logging.getLogger("dynamo_ppd.gateway")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
PSEUDO = (":authority", ":path", ":method", ":scheme")
# What Envoy's ext_proc lets no processor change when no mutation_rules are configured.
PROTECTED = frozenset({"host", ":authority", ":scheme", ":method"})
ENVOY_PREFIX = "x-envoy-"
# Removed by Envoy's connection manager before any filter runs (connection-specific, and Expect,
# which Envoy answers itself with 100 Continue).
_DROPPED = frozenset({"connection", "keep-alive", "proxy-connection", "upgrade", "expect", "te", "host"})
_Action = base_pb2.HeaderValueOption


def envoy_headers(head: RequestHead, request_id: str) -> Headers:
    """The header map Envoy shows the ext_proc server for this request (see the module doc)."""
    out: Headers = [(":authority", first(head.headers, "host") or ""), (":path", head.target),
                    (":method", head.method), (":scheme", "http")]
    out += [(k, v) for k, v in head.headers if k not in _DROPPED]
    if first(out, "x-forwarded-proto") is None:
        out.append(("x-forwarded-proto", "http"))
    if first(out, "x-request-id") is None:
        out.append(("x-request-id", request_id))
    return out


def to_header_map(headers: Headers) -> base_pb2.HeaderMap:
    """Headers as Envoy sends them: each value in ``raw_value`` bytes (Envoy's default since
    ``envoy.reloadable_features.send_header_raw_value``)."""
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1"))
                                       for k, v in headers])


def header_value(header: base_pb2.HeaderValue) -> str:
    """A HeaderValue's value: ``raw_value`` bytes when set, else ``value``."""
    if header.raw_value:
        return header.raw_value.decode("latin-1")
    return header.value


def _protected(name: str) -> bool:
    return name in PROTECTED or name.startswith(ENVOY_PREFIX)


def _valid(name: str, value: str) -> bool:
    """Envoy rejects a name or value that would break HTTP/1 framing; so do we, per entry."""
    token = name[1:] if name.startswith(":") else name
    return bool(token) and not any(c in token for c in "\r\n\0\t :") \
        and not any(c in value for c in "\r\n\0")


def _set(headers: Headers, name: str, value: str) -> Headers:
    """Overwrite: the first entry of ``name`` takes the value, the others go (none: append)."""
    out: Headers = []
    done = False
    for k, v in headers:
        if k != name:
            out.append((k, v))
        elif not done:
            out.append((k, value))
            done = True
    if not done:
        out.append((name, value))
    return out


def apply_header_mutation(headers: Headers, mutation: pb.HeaderMutation) -> Headers:
    """``headers`` after an ext_proc HeaderMutation, with Envoy's semantics (module doc)."""
    out = list(headers)
    for raw_name in mutation.remove_headers:
        name = raw_name.lower()
        if _protected(name) or name.startswith(":"):
            log.debug("ext_proc may not remove %s: ignored", name)
            continue
        out = [(k, v) for k, v in out if k != name]
    for option in mutation.set_headers:
        if not option.HasField("header"):
            continue
        name, value = option.header.key.lower(), header_value(option.header)
        if _protected(name) or not _valid(name, value):
            log.debug("ext_proc may not set %s: ignored", name)
            continue
        exists = any(k == name for k, _ in out)
        action = option.append_action
        if action == _Action.ADD_IF_ABSENT:
            append = True
            if exists:
                continue
        elif action == _Action.OVERWRITE_IF_EXISTS:
            append = False
            if not exists:
                continue
        elif action == _Action.OVERWRITE_IF_EXISTS_OR_ADD:
            append = False
        else:  # APPEND_IF_EXISTS_OR_ADD, the enum's default: the legacy BoolValue decides
            append = option.HasField("append") and option.append.value
        out = out + [(name, value)] if append else _set(out, name, value)
    return out


def merge_metadata(into: dict[str, Any], struct: struct_pb2.Struct) -> None:
    """Merge a response's dynamic_metadata into ``into``: the Struct's top-level keys are
    metadata namespaces, and a later response's keys in a namespace overwrite earlier ones (Envoy
    merges each namespace into the stream's dynamic metadata)."""
    for namespace, fields in json_format.MessageToDict(struct).items():
        if isinstance(fields, dict) and isinstance(into.get(namespace), dict):
            into[namespace].update(fields)
        else:
            into[namespace] = fields


def destination(headers: Headers, metadata: dict[str, Any]) -> str | None:
    """The picked endpoint, ``ip:port``: the destination header after mutation, else the
    ``envoy.lb`` metadata; None when the picker named none. The protocol allows a comma-separated
    list (the first is the pick, the rest fallbacks): the first is used."""
    value = first(headers, DESTINATION_HEADER)
    if not value:
        namespace = metadata.get(DESTINATION_NAMESPACE)
        value = namespace.get(DESTINATION_HEADER) if isinstance(namespace, dict) else None
    if isinstance(value, str) and value.strip():
        return value.split(",")[0].strip()
    return None


def upstream_request_parts(headers: Headers) -> tuple[str, str, Headers]:
    """(method, target, headers) of the request sent upstream: the pseudo-headers become the
    request line and Host (as Envoy's HTTP/1 codec encodes them), the rest go as they are."""
    method = first(headers, ":method") or "GET"
    target = first(headers, ":path") or "/"
    authority = first(headers, ":authority") or ""
    rest = [(k, v) for k, v in headers if not k.startswith(":")]
    return method, target, [("host", authority), *rest]
