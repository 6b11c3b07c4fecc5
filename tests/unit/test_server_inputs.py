"""The server's input checks with a fake engine (no compile): parse_inputs' every branch and its
limit at the boundary, EmbeddingService.embeddings' options and token limits, and the request body
handling of the HTTP server (body reading, strict JSON) over a real socket."""
from __future__ import annotations

import base64
import http.client
import json
import socket
import struct
import sys
import threading

import pytest

from builder.runtime.params import EngineParams
from builder.runtime.service import ApiError, EmbeddingService, ServerLimits, parse_inputs
from tests.serving import Running

WAIT = 5  # seconds any request may take before the test fails


def api_error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn(*args)
    return exc.value


# --- parse_inputs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("payload, expected", [
    ({"input": "a"}, (["a"], False)),
    ({"input": ["a", "b c"]}, (["a", "b c"], False)),
    ({"input": [1, 0, 2]}, ([[1, 0, 2]], True)),  # one token-id list is one input
    ({"input": [[1], [2, 3]]}, ([[1], [2, 3]], True)),
    ({"input": ["a"] * 4}, (["a"] * 4, False)),  # exactly max_inputs
    ({"input": [[7]] * 4}, ([[7]] * 4, True)),
    ({"input": list(range(9))}, ([list(range(9))], True)),  # 9 ids, one input: under the limit
])
def test_parse_inputs_accepts(payload, expected):
    assert parse_inputs(payload, 4) == expected


MIX = "'input' must be strings or lists of token ids, not a mix or other types"
NOT_LIST = "'input' must be a non-empty string or a non-empty list"


@pytest.mark.parametrize("payload, message, param, code", [
    ([], "request body must be a JSON object", None, "invalid_body"),
    ("input", "request body must be a JSON object", None, "invalid_body"),
    (None, "request body must be a JSON object", None, "invalid_body"),
    ({}, "'input' is required", "input", "missing_input"),
    ({"inputs": "a"}, "'input' is required", "input", "missing_input"),
    ({"input": ""}, "'input' contains an empty string", "input", "empty_input"),
    ({"input": ["a", ""]}, "'input' contains an empty string", "input", "empty_input"),
    ({"input": []}, NOT_LIST, "input", "invalid_input"),
    ({"input": None}, NOT_LIST, "input", "invalid_input"),
    ({"input": 5}, NOT_LIST, "input", "invalid_input"),
    ({"input": {"a": 1}}, NOT_LIST, "input", "invalid_input"),
    ({"input": ["a"] * 5}, "too many inputs: 5 > 4", "input", "too_many_inputs"),
    ({"input": [[1]] * 5}, "too many inputs: 5 > 4", "input", "too_many_inputs"),
    ({"input": ["a", 1]}, MIX, "input", "invalid_input"),
    ({"input": [[1], "a"]}, MIX, "input", "invalid_input"),
    ({"input": [[1], []]}, MIX, "input", "invalid_input"),
    ({"input": [[]]}, MIX, "input", "invalid_input"),
    ({"input": [[1, 2.0]]}, MIX, "input", "invalid_input"),
    ({"input": [[1, True]]}, MIX, "input", "invalid_input"),  # a bool is not a token id
    ({"input": [True, 1]}, MIX, "input", "invalid_input"),
    ({"input": [1.5]}, MIX, "input", "invalid_input"),
    ({"input": [None]}, MIX, "input", "invalid_input"),
])
def test_parse_inputs_rejects(payload, message, param, code):
    err = api_error(parse_inputs, payload, 4)
    assert (err.status, err.message, err.param, err.code) == (400, message, param, code)


# --- EmbeddingService.embeddings -----------------------------------------------------------------

class FakeEncoder:
    vocab_size = 100

    def __init__(self):
        self.encoded: list[list[str]] = []
        self.fail_with: Exception | None = None

    def format_query(self, text: str) -> str:
        return f"Q:{text}"

    def encode(self, texts, max_tokens=None, direction="right", known=None):
        if known and max_tokens is None and all(t in known for t in texts):  # tokenized already (tokenbatch)
            return [list(known[t]) for t in texts]
        self.encoded.append(list(texts))
        if self.fail_with is not None:
            raise self.fail_with
        return [[ord(c) % 100 for c in t] for t in texts]


class FakeEngine:
    """What EmbeddingService uses of an engine; a vector names its sequence (first id, length, sum)."""

    dim = 3

    def __init__(self, max_seq_len: int = 16):
        self.params = EngineParams(max_seq_len=max_seq_len, max_batch=8, model_name="fake-model")
        self.encoder = FakeEncoder()
        self.seen: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()

    def embed_ids(self, seqs):
        assert self.release.wait(WAIT)
        self.seen.extend(seqs)
        return [[float(s[0]), float(len(s)), float(sum(s))] for s in seqs]


def vec(seq):
    return [float(seq[0]), float(len(seq)), float(sum(seq))]


@pytest.fixture
def make_service():
    made = []

    def factory(max_seq_len=16, **limits) -> EmbeddingService:
        engine = FakeEngine(max_seq_len)
        service = EmbeddingService(engine, ServerLimits(**{"max_batch": 8, "max_wait_ms": 1, "max_inputs": 4,
                                                           **limits}))
        made.append(service)
        return service

    yield factory
    for service in made:
        service.engine.release.set()
        service.close()


def ids(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def test_embeds_texts(make_service):
    service = make_service()
    body, tokens = service.embeddings({"input": ["ab", "cde"]})
    assert tokens == 5
    assert body == {"object": "list", "model": "fake-model", "usage": {"prompt_tokens": 5, "total_tokens": 5},
                    "data": [{"object": "embedding", "index": 0, "embedding": vec(ids("ab"))},
                             {"object": "embedding", "index": 1, "embedding": vec(ids("cde"))}]}
    assert service.engine.encoder.encoded == [["ab", "cde"]]  # documents: no query instruction


def test_model_name_defaults(make_service):
    service = make_service()
    service.engine.params = EngineParams(max_seq_len=16)
    assert EmbeddingService(service.engine, service.limits).model_name == "mopt-embedding"


@pytest.mark.parametrize("payload_extra", [{}, {"input_type": "document"}])
def test_documents_are_encoded_as_they_are(make_service, payload_extra):
    service = make_service()
    service.embeddings({"input": "x", **payload_extra})
    assert service.engine.encoder.encoded == [["x"]]


def test_queries_get_the_instruction(make_service):
    service = make_service()
    body, tokens = service.embeddings({"input": ["x"], "input_type": "query"})
    assert service.engine.encoder.encoded == [["Q:x"]]
    assert body["data"][0]["embedding"] == vec(ids("Q:x")) and tokens == 3


def test_token_ids_bypass_the_tokenizer(make_service):
    service = make_service()
    body, tokens = service.embeddings({"input": [[0, 99], [5]], "input_type": "query"})
    assert service.engine.encoder.encoded == []
    assert [d["embedding"] for d in body["data"]] == [vec([0, 99]), vec([5])] and tokens == 3


@pytest.mark.parametrize("bad", [100, -1, 1000])
def test_token_ids_out_of_the_vocabulary(make_service, bad):
    service = make_service()
    err = api_error(service.embeddings, {"input": [[1, 2], [3, bad]]})
    assert (err.status, err.message, err.param, err.code) == (400, "token ids must be in 0..99", "input",
                                                             "invalid_token_id")
    assert service.engine.seen == []


@pytest.mark.parametrize("fmt", [None, "", "float"])
def test_float_encoding(make_service, fmt):
    body, _ = make_service().embeddings({"input": [[1, 2]], "encoding_format": fmt})
    assert body["data"][0]["embedding"] == [1.0, 2.0, 3.0]


def test_base64_encoding_is_little_endian_float32(make_service):
    body, _ = make_service().embeddings({"input": [[1, 2]], "encoding_format": "base64"})
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert raw == struct.pack("<3f", 1.0, 2.0, 3.0)


NO_MATRYOSHKA = "this model does not support Matryoshka dimensions: it only produces 3 dimensions"


@pytest.mark.parametrize("payload, message, param, code", [
    ({"encoding_format": "FLOAT"}, "encoding_format must be 'float' or 'base64'", "encoding_format",
     "invalid_encoding_format"),
    ({"encoding_format": "binary"}, "encoding_format must be 'float' or 'base64'", "encoding_format",
     "invalid_encoding_format"),
    ({"dimensions": 2}, NO_MATRYOSHKA, "dimensions", "invalid_dimensions"),
    ({"dimensions": 4}, NO_MATRYOSHKA, "dimensions", "invalid_dimensions"),
    ({"dimensions": "3"}, "dimensions must be an integer", "dimensions", "invalid_dimensions"),
    ({"input_type": "passage"}, "input_type must be 'query' or 'document'", "input_type", "invalid_input_type"),
    ({"input_type": None}, "input_type must be 'query' or 'document'", "input_type", "invalid_input_type"),
])
def test_bad_options(make_service, payload, message, param, code):
    service = make_service()
    err = api_error(service.embeddings, {"input": "x", **payload})
    assert (err.status, err.message, err.param, err.code) == (400, message, param, code)
    assert service.engine.seen == []


def test_dimensions_equal_to_the_models_pass(make_service):
    body, _ = make_service().embeddings({"input": [[1]], "dimensions": 3})
    assert body["data"][0]["embedding"] == vec([1])


@pytest.mark.parametrize("exc", [UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"),
                                 ValueError("bad"), TypeError("bad")])
def test_text_that_cannot_be_tokenized(make_service, exc):
    service = make_service()
    service.engine.encoder.fail_with = exc
    err = api_error(service.embeddings, {"input": "x"})
    assert (err.status, err.message, err.param, err.code) == (
        400, f"'input' cannot be tokenized: {type(exc).__name__}", "input", "invalid_input")


def test_other_tokenizer_failures_are_not_blamed_on_the_input(make_service):
    service = make_service()
    service.engine.encoder.fail_with = RuntimeError("tokenizer bug")
    with pytest.raises(RuntimeError, match="tokenizer bug"):  # the handler answers 500
        service.embeddings({"input": "x"})


@pytest.mark.parametrize("max_seq_len, max_input_tokens, limit", [(16, None, 16), (16, 8, 8), (16, 100, 16)])
def test_context_length_at_the_limit(make_service, max_seq_len, max_input_tokens, limit):
    service = make_service(max_seq_len, max_input_tokens=max_input_tokens)
    assert service.max_tokens == limit
    body, tokens = service.embeddings({"input": [[1], [2] * limit]})  # exactly the limit passes
    assert tokens == limit + 1 and body["data"][1]["embedding"] == vec([2] * limit)
    err = api_error(service.embeddings, {"input": [[1], [2] * (limit + 1)]})
    assert (err.status, err.message, err.param, err.code) == (
        400, f"input 1 has {limit + 1} tokens, more than the maximum {limit}", "input", "context_length_exceeded")


def test_context_length_of_text_counts_its_tokens(make_service):
    service = make_service(16)
    assert service.embeddings({"input": "a" * 16})[1] == 16
    err = api_error(service.embeddings, {"input": ["ok", "a" * 17]})
    assert err.message == "input 1 has 17 tokens, more than the maximum 16"


def test_too_many_inputs_uses_the_service_limit(make_service):
    service = make_service(max_inputs=2)
    assert len(service.embeddings({"input": ["a", "b"]})[0]["data"]) == 2
    assert api_error(service.embeddings, {"input": ["a", "b", "c"]}).message == "too many inputs: 3 > 2"


def test_engine_timeout_is_a_503(make_service):
    service = make_service(request_timeout_s=0.05)
    service.engine.release.clear()
    err = api_error(service.embeddings, {"input": "x"})
    assert (err.status, err.message, err.code) == (503, "timed out waiting for the engine", "timeout")
    assert err.body()["error"]["type"] == "server_error"


# --- the body over a real socket ---------------------------------------------------------------------

MAX_BODY = 4096


@pytest.fixture
def server(make_service):
    service = make_service(max_body_bytes=MAX_BODY)
    # How long a client that announces more than it sends is waited for: short here (60 s in the product).
    running = Running(service, request_timeout_s=0.3)
    yield running.port
    running.stop()


def post(port: int, body: bytes, length: str | None = "auto", shut: bool = False,
         ctype: str = "application/json") -> tuple[int, dict]:
    """POST /v1/embeddings with the Content-Length given (None: no header); shut: end the upload early."""
    headers = ["POST /v1/embeddings HTTP/1.1", "Host: test", f"Content-Type: {ctype}"]
    if length is not None:
        headers.append(f"Content-Length: {len(body) if length == 'auto' else length}")
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        sock.sendall(("\r\n".join(headers) + "\r\n\r\n").encode() + body)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def error_of(answer: tuple[int, dict]) -> tuple[int, str, str]:
    status, body = answer
    return status, body["error"]["code"], body["error"]["message"]


def test_valid_body(server):
    status, body = post(server, b'{"input": [[1, 2]]}')
    assert status == 200 and body["data"][0]["embedding"] == vec([1, 2])


def test_body_of_exactly_the_limit_is_read(server):
    raw = b'{"input": [[1]]}'
    raw += b" " * (MAX_BODY - len(raw))
    status, body = post(server, raw)
    assert status == 200 and body["data"][0]["embedding"] == vec([1])


def test_body_over_the_limit_is_refused_unread(server):
    assert error_of(post(server, b"", length=str(MAX_BODY + 1))) == (
        413, "body_too_large", f"body of {MAX_BODY + 1} bytes exceeds {MAX_BODY}")


def test_content_length_required(server):
    assert error_of(post(server, b"", length=None)) == (411, "length_required", "Content-Length header required")


def test_bytes_after_a_request_without_content_length_are_not_a_body(server):
    # Without Content-Length a request has no body: what follows is parsed as the next request (refused).
    assert post(server, b'{"input": "x"}', length=None)[0] == 400


@pytest.mark.parametrize("length", ["abc", "", "-1", "+14", "0x11", "1_4"])
def test_content_length_not_digits(server, length):
    status, code, _ = error_of(post(server, b'{"input": "x"}', length=length))
    assert (status, code) == (400, "bad_request")


def test_empty_body_is_not_json(server):
    assert error_of(post(server, b"", length="0")) == (
        400, "invalid_json", "body is not valid JSON: Expecting value: line 1 column 1 (char 0)")


def test_body_shorter_than_announced(server):
    # The peer ends its upload early: nobody is left to read an answer, and none is written.
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
        post(server, b'{"input"', length="20", shut=True)


def test_body_never_sent_times_out(server):
    assert error_of(post(server, b'{"input"', length="20")) == (
        408, "request_timeout", "body not received within 0.3s")


@pytest.mark.parametrize("raw, message", [
    (b'{"input": "x"', "body is not valid JSON: Expecting ',' delimiter: line 1 column 14 (char 13)"),
    (b'{"input": "\xff"}', "body is not UTF-8"),
    ('{"input": "x"}'.encode("utf-16"), "body is not UTF-8"),
    ('{"input": "x"}'.encode("utf-32-le"), "body is not valid JSON: Expecting property name enclosed in double "
                                           "quotes: line 1 column 2 (char 1)"),
    (b'\xef\xbb\xbf{"input": "x"}', "body is not valid JSON: Unexpected UTF-8 BOM (decode using utf-8-sig): "
                                    "line 1 column 1 (char 0)"),
    (b'{"input": "x", "input": "y"}', "body is not valid JSON: duplicate key 'input'"),
    (b'{"input": "x", "dimensions": NaN}', "body is not valid JSON: NaN is not JSON (RFC 8259)"),
    (b'{"input": "x", "dimensions": Infinity}', "body is not valid JSON: Infinity is not JSON (RFC 8259)"),
    (b'{"input": "x", "dimensions": -Infinity}', "body is not valid JSON: -Infinity is not JSON (RFC 8259)"),
])
def test_invalid_json(server, raw, message):
    assert error_of(post(server, raw)) == (400, "invalid_json", message)


def test_duplicate_keys_are_refused_in_nested_objects_too(server):
    status, code, message = error_of(post(server, b'{"input": "x", "user": {"a": 1, "a": 2}}'))
    assert (status, code, message) == (400, "invalid_json", "body is not valid JSON: duplicate key 'a'")


def test_deeply_nested_json(server):
    # json's nesting bound is the interpreter's recursion limit, which libraries loaded by other tests
    # (torch's compiler) raise: hold it at Python's default here.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        assert error_of(post(server, b"[" * 1500 + b"]" * 1500)) == (400, "invalid_json", "body is nested too deeply")
    finally:
        sys.setrecursionlimit(limit)


def test_the_json_reaches_the_input_checks(server):
    assert error_of(post(server, b'{"input": []}')) == (400, "invalid_input", NOT_LIST)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   "application/json; charset=utf-16", "application/jsonx", ""])
def test_only_json_bodies_are_read(server, ctype):
    # A cross-site "simple" POST can send text/plain, form data and multipart, never application/json.
    status, code, _ = error_of(post(server, b'{"input": [[1]]}', ctype=ctype))
    assert (status, code) == (415, "unsupported_media_type")


@pytest.mark.parametrize("ctype", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                   'application/json;charset="UTF-8"'])
def test_json_content_types_are_read(server, ctype):
    assert post(server, b'{"input": [[1]]}', ctype=ctype)[0] == 200
