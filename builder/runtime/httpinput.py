"""The rules a request must meet before its body is read or used, apart from the transport: Host,
the entity's headers (Content-Type, Content-Encoding, framing, size) and strict JSON. Plain functions
of headers and bytes, so tests (and the mutation check) call them directly; server.py applies them.

Headers are a dict of lower-cased names (bytes) to their values (bytes), in arrival order."""
from __future__ import annotations

import json

from .service import ApiError

# A Host value: a registered name, IPv4 or [IPv6] literal, and an optional port (RFC 3986 host chars).
HOST_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~%!$&'()*+,;=:[]")
JSON_CHARSETS = ("utf-8", "utf8")


def error_body(status: int, message: str, code: str | None) -> dict:
    """The JSON error body every answer uses (ApiError's), for answers made outside a route."""
    return ApiError(status, message, code=code).body()


class Refusal(Exception):
    """An answer decided before or while reading the body: status, body, headers, and whether the
    connection must close (a body that will not be read)."""

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.code, self.close = status, code, close
        self.body = error_body(status, message, code)
        self.headers = headers or {}


def check_host(version: str, headers: dict) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request has exactly one Host, with a valid value (HTTP/1.0 may omit it)."""
    hosts = headers.get(b"host", [])
    if version == "1.1" and len(hosts) != 1:
        what = "no Host header" if not hosts else "more than one Host header"
        raise Refusal(400, f"HTTP/1.1 request with {what}", "invalid_host", close=True)
    for host in hosts:
        if not host or not HOST_CHARS.issuperset(host):  # no "@" in HOST_CHARS: userinfo is refused too
            raise Refusal(400, "invalid Host header", "invalid_host", close=True)


def check_entity(headers: dict, max_body_bytes: int) -> int:
    """Content-Type, Content-Encoding and framing of a POST; returns its Content-Length."""
    ctype = headers.get(b"content-type", [b""])[0].decode("latin-1")
    media, _, params = ctype.partition(";")
    if media.strip().lower() != "application/json":
        # A cross-site "simple" POST (text/plain, forms) cannot send application/json.
        raise Refusal(415, "Content-Type must be application/json", "unsupported_media_type", close=True)
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in JSON_CHARSETS:
            raise Refusal(415, "the body must be UTF-8 JSON (charset=utf-8)", "unsupported_media_type", close=True)
    for value in headers.get(b"content-encoding", []):
        if any(t.strip().lower() not in (b"identity", b"") for t in value.split(b",")):
            raise Refusal(415, "Content-Encoding is not supported; send the JSON body as it is",
                          "unsupported_encoding", close=True)
    if headers.get(b"transfer-encoding"):
        # Chunked bodies are refused rather than decoded: clients of an embeddings API send JSON of
        # known size, and admission needs the size before the body is read.
        raise Refusal(411, "Transfer-Encoding is not supported; send Content-Length", "length_required", close=True)
    lengths = headers.get(b"content-length")
    if not lengths:
        raise Refusal(411, "Content-Length header required", "length_required", close=True)
    length = int(lengths[0])  # the parser (llhttp) has refused anything but one plain decimal value
    if length > max_body_bytes:
        raise Refusal(413, f"body of {length} bytes exceeds {max_body_bytes}", "body_too_large", close=True)
    return length


def _no_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key[:40]!r}")
        obj[key] = value
    return obj


def _no_constants(name):
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def parse_json(raw: bytes):
    """RFC 8259 JSON in UTF-8: no other encoding (UTF-16/32 or a BOM), no duplicate keys, no NaN or
    Infinity, nesting bounded by the parser's recursion limit; a 400 otherwise."""
    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise ApiError(400, "body is not UTF-8", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, constants, an integer of too many digits
        raise ApiError(400, f"body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
