"""Small requests' texts tokenized together off the event loop (builder/runtime/tokenbatch.py): one encode
call a loop turn, ids identical to the request's own tokenizing, a bad text costing the others nothing,
and no request left waiting (cancelled, closed). The server's use: test_server_http.py."""
from __future__ import annotations

import asyncio
import threading

import pytest

from builder.runtime.params import EngineParams
from builder.runtime.service import EmbeddingService, ServerLimits
from builder.runtime.tiny_qwen3 import make_tiny_qwen3
from builder.runtime.tokenbatch import TokenBatches
from builder.runtime.tokenization import TextEncoder

pytestmark = pytest.mark.runtime


class Encoder:
    """One id per character; records each call (its texts and thread); refuses texts containing '!'."""

    def __init__(self):
        self.calls: list[tuple[list[str], str]] = []

    def encode(self, texts, max_tokens=None, direction="right", keep_prefix="", known=None):
        self.calls.append((list(texts), threading.current_thread().name))
        if any("!" in t for t in texts):
            raise TypeError("refused")
        return [[ord(c) for c in t] for t in texts]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_the_texts_of_one_loop_turn_are_tokenized_in_one_call_off_the_loop():
    enc, batches = Encoder(), TokenBatches()

    async def main():
        return await asyncio.gather(*(batches.ids(enc, texts) for texts in (["ab", "c"], ["c"], ["d"])))

    got = run(main())
    assert [{t: k[t] for t in texts} for k, texts in zip(got, (["ab", "c"], ["c"], ["d"]), strict=True)] == [
        {"ab": [97, 98], "c": [99]}, {"c": [99]}, {"d": [100]}]
    assert enc.calls == [(["ab", "c", "d"], enc.calls[0][1])]  # once, each text once
    assert enc.calls[0][1].startswith("mopt-tokenize-batch") and batches.batches == 1
    batches.close()


def test_a_batch_is_sent_at_its_size_limit_and_the_rest_waits_for_the_turn():
    enc, batches = Encoder(), TokenBatches(max_texts=2)

    async def main():
        return await asyncio.gather(*(batches.ids(enc, [t]) for t in "abcde"))

    got = run(main())
    assert [k[t] for k, t in zip(got, "abcde", strict=True)] == [[97], [98], [99], [100], [101]]
    assert [texts for texts, _ in enc.calls] == [["a", "b"], ["c", "d"], ["e"]] and batches.batches == 3
    batches.close()


def test_a_text_the_tokenizer_refuses_costs_the_other_requests_nothing():
    enc, batches = Encoder(), TokenBatches()

    async def main():
        return await asyncio.gather(batches.ids(enc, ["ok"]), batches.ids(enc, ["bad!"]), batches.ids(enc, ["x"]))

    good, bad, other = run(main())
    assert (good, bad, other) == ({"ok": [111, 107]}, {}, {"x": [120]})  # the bad one tokenizes in prepare()
    assert [texts for texts, _ in enc.calls] == [["ok", "bad!", "x"], ["ok"], ["bad!"], ["x"]]
    batches.close()


def test_a_cancelled_request_leaves_the_others_answered_and_a_closed_one_answers_none():
    enc, batches = Encoder(), TokenBatches()

    async def main():
        leaving = asyncio.ensure_future(batches.ids(enc, ["gone"]))
        staying = asyncio.ensure_future(batches.ids(enc, ["here"]))
        await asyncio.sleep(0)
        leaving.cancel()
        answer = await staying
        batches.close()
        return answer, await batches.ids(enc, ["after close"]), await batches.ids(enc, [])

    assert run(main()) == ({"gone": [103, 111, 110, 101], "here": [104, 101, 114, 101]}, {}, {})


def test_another_encoder_starts_its_own_batch():
    first, second, batches = Encoder(), Encoder(), TokenBatches()

    async def main():
        return await asyncio.gather(batches.ids(first, ["a"]), batches.ids(second, ["a"]))

    assert run(main()) == [{"a": [97]}, {"a": [97]}]
    assert len(first.calls) == len(second.calls) == 1 and batches.batches == 2
    batches.close()


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> TextEncoder:
    return TextEncoder(make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model", seed=0), pooling="last")


def test_known_ids_are_the_encoders_own_and_copies(tiny_encoder):
    texts = ["hello world", "the cat", "hello world", "日本語のテキスト"]
    known = dict(zip(texts[:2], tiny_encoder.encode(texts[:2]), strict=True))
    got = tiny_encoder.encode(texts, known=known)
    assert got == tiny_encoder.encode(texts)  # the unknown ones encoded, the known ones taken
    got[0].append(-1)
    assert known["hello world"][-1] != -1 and got[2][-1] != -1  # each request's lists are its own
    assert tiny_encoder.encode(texts, max_tokens=3, known=known) == tiny_encoder.encode(texts, max_tokens=3)


class Engine:
    dim = 2

    def __init__(self):
        self.params = EngineParams(max_seq_len=16, max_batch=4, model_name="m")
        self.encoder = Encoder()

    def embed_ids(self, seqs):
        return [[1.0, 0.0] for _ in seqs]


@pytest.mark.parametrize(("route", "payload", "expected"), [
    ("/v1/embeddings", {"input": "ab"}, ["ab"]),
    ("/v1/embeddings", {"input": ["ab", "c"], "model": "m"}, ["ab", "c"]),
    ("/embeddings", {"input": ["ab"], "truncate_prompt_tokens": 4, "truncation_side": "left"}, ["ab"]),  # cut after
    ("/embeddings", {"input": ["ab"], "truncate_prompt_tokens": -1}, []),  # the text's tokens cut: in prepare()
    ("/embed", {"inputs": ["ab"], "truncate": False}, ["ab"]),
    ("/", {"inputs": "ab"}, ["ab"]),
    ("/v1/embeddings", {"input": ["ab"], "truncate_prompt_tokens": 4}, []),  # cut: tokenized in prepare()
    ("/embed", {"inputs": ["ab"], "truncate": True}, []),
    ("/v1/embeddings", {"input": ["ab"], "input_type": "query"}, []),  # formatted first
    ("/embed", {"inputs": ["ab"], "prompt_name": "query"}, []),
    ("/v1/embeddings", {"input": ["ab"], "truncate_prompt_tokens": "x"}, []),  # refused before tokenizing
    ("/v1/embeddings", {"input": ["a" * 65]}, []),  # over max_input_chars
    ("/v1/embeddings", {"input": ["a" * 64]}, ["a" * 64]),  # at it
    ("/v1/embeddings", {"input": ["a"] * 5}, []),  # over max_inputs
    ("/v1/embeddings", {"input": ["a"] * 4}, ["a"] * 4),  # at it
    ("/v1/embeddings", {"input": [[1, 2]]}, []),  # token ids
    ("/v1/embeddings", {"input": ["a", 3]}, []),
    ("/v1/embeddings", ["a"], []),
    ("/tokenize", {"inputs": ["ab"], "input": ["ab"]}, []),  # no engine call: nothing to tokenize ahead
    ("/decode", {"ids": [1], "input": ["ab"]}, []),
    ("/nowhere", {"input": ["ab"]}, []),
])
def test_the_texts_to_tokenize_ahead_are_those_prepare_tokenizes_whole(route, payload, expected):
    service = EmbeddingService(Engine(), ServerLimits(max_inputs=4, max_input_chars=64))
    try:
        assert service.texts_to_tokenize(route, payload) == expected
    finally:
        service.close(1)
