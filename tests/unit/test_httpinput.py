"""The request rules of builder/runtime/httpinput.py called directly: Host, the entity's headers and
strict JSON, every branch and its message (the HTTP tests check the same rules over sockets)."""
from __future__ import annotations

import pytest

from builder.runtime.httpinput import Refusal, check_entity, check_host, parse_json
from builder.runtime.service import ApiError

JSON = [b"application/json"]


def refusal(fn, *args) -> tuple:
    with pytest.raises(Refusal) as err:
        fn(*args)
    r = err.value
    return r.status, r.code, str(r), r.close, r.body["error"]["code"]


@pytest.mark.parametrize("version, hosts", [("1.1", [b"a"]), ("1.1", [b"example.com:8000"]), ("1.1", [b"[::1]:80"]),
                                            ("1.0", []), ("1.0", [b"a"]), ("1.1", [b"x_y-z.~%!$&'()*+,;=:"])])
def test_valid_hosts(version, hosts):
    assert check_host(version, {b"host": hosts} if hosts else {}) is None


@pytest.mark.parametrize("version, hosts, message", [
    ("1.1", [], "HTTP/1.1 request with no Host header"),
    ("1.1", [b"a", b"a"], "HTTP/1.1 request with more than one Host header"),
    ("1.1", [b""], "invalid Host header"),
    ("1.1", [b"a b"], "invalid Host header"),
    ("1.1", [b"user@a"], "invalid Host header"),
    ("1.1", [b"a/b"], "invalid Host header"),
    ("1.0", [b"a", b"b c"], "invalid Host header"),
])
def test_invalid_hosts(version, hosts, message):
    assert refusal(check_host, version, {b"host": hosts}) == (400, "invalid_host", message, True, "invalid_host")


def entity(**headers) -> dict:
    out = {b"content-type": JSON, b"content-length": [b"10"]}
    for name, value in headers.items():
        key = name.replace("_", "-").encode()
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value if isinstance(value, list) else [value]
    return out


@pytest.mark.parametrize("headers, length", [
    (entity(), 10),
    (entity(content_length=b"0"), 0),
    (entity(content_length=b"100"), 100),  # exactly the limit
    (entity(content_type=b"Application/JSON"), 10),
    (entity(content_type=b" application/json ; charset=utf-8"), 10),
    (entity(content_type=b'application/json;charset="UTF8"'), 10),
    (entity(content_type=b"application/json; boundary=x"), 10),  # other parameters are ignored
    (entity(content_encoding=b"identity"), 10),
    (entity(content_encoding=[b"Identity", b""]), 10),
    (entity(content_encoding=b"identity, identity"), 10),  # a list of codings, split at its commas
])
def test_entities_that_pass(headers, length):
    assert check_entity(headers, 100) == length


@pytest.mark.parametrize("headers, status, code, message", [
    (entity(content_type=None), 415, "unsupported_media_type", "Content-Type must be application/json"),
    (entity(content_type=b"text/plain"), 415, "unsupported_media_type", "Content-Type must be application/json"),
    (entity(content_type=b"application/jsonx"), 415, "unsupported_media_type",
     "Content-Type must be application/json"),
    (entity(content_type=b"application/json; charset=utf-16"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),
    (entity(content_type=b"application/json; charset=Xutf-8X"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),
    (entity(content_type=b"application/json; charset=latin-1"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),
    (entity(content_type=b"application/json; boundary=x; charset=latin-1"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),  # every parameter is read, not only the first
    (entity(content_type=b"application/json; boundary=x;charset=latin-1"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),  # parameters split at ';', spaces or none
    # the parameter's name is what comes before its first "=": this charset is "latin-1=utf-8", not utf-8
    (entity(content_type=b"application/json; charset=latin-1=utf-8"), 415, "unsupported_media_type",
     "the body must be UTF-8 JSON (charset=utf-8)"),
    (entity(content_encoding=b"gzip"), 415, "unsupported_encoding",
     "Content-Encoding is not supported; send the JSON body as it is"),
    (entity(content_encoding=b"identity, br"), 415, "unsupported_encoding",
     "Content-Encoding is not supported; send the JSON body as it is"),
    (entity(content_encoding=[b"identity", b"deflate"]), 415, "unsupported_encoding",
     "Content-Encoding is not supported; send the JSON body as it is"),
    (entity(transfer_encoding=b"chunked", content_length=None), 411, "length_required",
     "Transfer-Encoding is not supported; send Content-Length"),
    (entity(content_length=None), 411, "length_required", "Content-Length header required"),
    (entity(content_length=b"101"), 413, "body_too_large", "body of 101 bytes exceeds 100"),
])
def test_entities_refused(headers, status, code, message):
    assert refusal(check_entity, headers, 100) == (status, code, message, True, code)


def test_a_refusal_carries_its_headers_and_openai_error_body():
    r = Refusal(503, "busy", "server_busy", {"Retry-After": "1"})
    assert (r.headers, r.close) == ({"Retry-After": "1"}, False)
    assert r.body == {"error": {"message": "busy", "type": "server_error", "param": None, "code": "server_busy"}}
    assert Refusal(400, "bad", "x").body["error"]["type"] == "invalid_request_error"
    assert Refusal(400, "bad", "x").headers == {}


@pytest.mark.parametrize("raw, value", [
    (b'{"input": "x"}', {"input": "x"}),
    (b'{"a": {"b": 1}, "c": [1, 2.5, null, true]}', {"a": {"b": 1}, "c": [1, 2.5, None, True]}),
    ('{"input": "\u4e2d"}'.encode(), {"input": "\u4e2d"}),
    (b'[{"a": 1}, {"a": 2}]', [{"a": 1}, {"a": 2}]),  # the same key in two objects is no duplicate
])
def test_json_that_parses(raw, value):
    assert parse_json(raw) == value


@pytest.mark.parametrize("raw, message", [
    (b'{"a": 1, "a": 2}', "body is not valid JSON: duplicate key 'a'"),
    (b'{"a": {"b": 1, "b": 1}}', "body is not valid JSON: duplicate key 'b'"),
    (b'{"' + b"k" * 50 + b'": 1, "' + b"k" * 50 + b'": 2}', "body is not valid JSON: duplicate key '" + "k" * 40 + "'"),
    (b'{"a": NaN}', "body is not valid JSON: NaN is not JSON (RFC 8259)"),
    (b'{"a": Infinity}', "body is not valid JSON: Infinity is not JSON (RFC 8259)"),
    (b'{"a": -Infinity}', "body is not valid JSON: -Infinity is not JSON (RFC 8259)"),
    (b'\xff', "body is not UTF-8"),
    (b'{"a": "\xed\xa0\x80"}', "body is not UTF-8"),  # a surrogate encoded in UTF-8
    (b"", "body is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    (b"[" * 100_000, "body is nested too deeply"),
])
def test_json_refused(raw, message):
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # other tests' libraries raise it: hold Python's default here
    try:
        with pytest.raises(ApiError) as err:
            parse_json(raw)
    finally:
        sys.setrecursionlimit(limit)
    assert (err.value.status, err.value.code, err.value.message) == (400, "invalid_json", message)


def test_a_long_error_message_is_cut():
    with pytest.raises(ApiError) as err:
        parse_json(b'{"' + b"x" * 500 + b'": 1, "' + b"x" * 500 + b'": 2}')
    assert len(err.value.message) <= len("body is not valid JSON: ") + 200
