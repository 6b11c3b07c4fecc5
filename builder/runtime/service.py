"""Request logic of the embeddings server, apart from HTTP: limits, input validation, truncation,
Matryoshka dimensions, the OpenAI and TEI request shapes, and the batcher in front of the engine.
Tests call it directly.

Every error is an ApiError in OpenAI's error format, on the TEI route (/embed) as well: one error
shape for every route of the image (TEI's own is {"error": ..., "error_type": ...})."""
from __future__ import annotations

import base64
import logging
import math
import struct
import threading
import time
from dataclasses import asdict, dataclass

from .batcher import Batcher, Dropped, QueueFull
from .errors import UsageError
from .metrics import Metrics
from .tokenization import cut

log = logging.getLogger(__name__)

# max_input_chars when unset: characters per token allowed, times the token limit. Prose averages
# 3-5 characters per WordPiece/BPE token; 8 leaves room for code, URLs and long words while keeping
# the text handed to the tokenizer (which costs hundreds of bytes per character while it encodes)
# proportional to what the engine can take, instead of the whole 4 MiB body.
CHARS_PER_TOKEN = 8
# Characters per tokenizer call: a request is encoded in groups of about this many characters,
# checking the token limits after each, so its peak memory stays bounded by one group.
TOKENIZE_GROUP_CHARS = 1 << 18
# Bytes an answer holds per value while it is written: its float32 (4) and its JSON text (at most 16).
ANSWER_BYTES_PER_VALUE = 20
# ... and per token of a /tokenize answer: its dict of five fields while built, and its JSON text.
TOKEN_ANSWER_BYTES = 600
# How often a waiting request looks at its deadline and its client (seconds).
WAIT_SLICE_S = 0.1


@dataclass(frozen=True)
class ServerLimits:
    """Serving limits; each has a safe default and a serve flag / MOPT_* variable (__main__.py)."""

    max_batch: int = 32  # inputs per engine call
    # Tokens per engine call (the batcher's token budget); None: a packed engine's own budget, none for
    # a padded engine (its calls are cut by padded shape, engine.plan_calls).
    max_batch_tokens: int | None = None
    max_wait_ms: float = 5.0  # how long the batcher waits to fill a batch
    # Inputs per request: OpenAI's own limit. langchain-openai sends 1,000 a request by default; the batcher
    # cuts them into engine calls, and their answer is reserved under the in-flight byte budget (server.py).
    max_inputs: int = 2048
    max_input_tokens: int | None = None  # tokens per input; None: the engine's max_seq_len (also the ceiling)
    max_body_bytes: int = 4 * 1024 * 1024  # request body (the transport enforces it)
    request_timeout_s: float = 120.0  # whole-request deadline when the transport passes none
    # Characters per input, checked before tokenizing; None: CHARS_PER_TOKEN * the token limit.
    max_input_chars: int | None = None
    # Tokens per request, all inputs together, after truncation: 256 inputs of 512 tokens (a BERT-size
    # context) or 1,000 of 131 fit; a long-context model cannot take more than this much
    # engine time (and queue memory, ~40 bytes a token) from one request.
    max_request_tokens: int = 131072
    # Tokens waiting for the engine, all requests together; beyond it 503 + Retry-After. Two full
    # requests: enough to keep the engine busy, while a queued request's wait stays bounded.
    # An empty queue takes any request that passed max_request_tokens.
    max_queue_tokens: int = 262144
    # Truncate over-long inputs when a request does not say. Off: a silent cut changes the embedding
    # without telling the client, so over-long input is a 400 unless asked for (TEI's default too).
    auto_truncate: bool = False
    # The engine's heartbeat (batcher.py): an idle batcher pings the engine this often (None: never), and a
    # call counts as stalled past max(engine_stall_s, 4 x its expected time).
    engine_ping_s: float | None = None
    engine_stall_s: float = 5.0
    # Engine calls in flight: 2 sends the next batch while one runs, so the engine never waits for the
    # server between calls (batcher.py); 1 waits for each call to end.
    engine_depth: int = 2
    # An idle engine's batch goes out once no request came for this long (capped by max_wait_ms).
    batch_quiet_ms: float = 2.0
    # --served-model-name: the name in responses and /v1/models, then its aliases (empty: the engine's).
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_request_tokens", "max_queue_tokens", "max_input_chars", "max_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")


MODEL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8", "fp8": "float8_e4m3fn"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})  # extra response headers, e.g. Retry-After on a full queue

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Work:
    """A checked, tokenized request: the token ids for the engine, and what turns vectors into the body."""

    seqs: list
    tokens: int
    finish: object  # callable(vectors) -> the response body
    answer_bytes: int | None = None  # what the answer holds while written; None: the vectors' (answer_bytes())


@dataclass(frozen=True)
class Truncation:
    max_tokens: int
    direction: str  # "right": keep the start; "left": keep the end
    # vLLM's explicit truncation_side: the whole encoding is cut, special tokens included (without it the
    # text's tokens are cut and the special tokens kept, as transformers' truncation does)
    whole: bool = False


def parse_inputs(payload, max_inputs: int, key: str = "input") -> tuple[list, bool]:
    """Return (inputs, are_token_ids). Accepts a string, a list of strings, a list of token ids,
    or a list of token-id lists, as OpenAI does. key: 'input' (OpenAI) or 'inputs' (TEI)."""
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if key not in payload:
        raise ApiError(400, f"'{key}' is required", param=key, code="missing_input")
    raw = payload[key]
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(type(x) is int for x in raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, f"'{key}' must be a non-empty string or a non-empty list", param=key,
                       code="invalid_input")
    if len(raw) > max_inputs:
        raise ApiError(400, f"too many inputs: {len(raw)} > {max_inputs}", param=key, code="too_many_inputs")
    if all(isinstance(x, str) for x in raw):
        if any(not x for x in raw):
            raise ApiError(400, f"'{key}' contains an empty string", param=key, code="empty_input")
        return raw, False
    if all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in raw):
        return raw, True
    raise ApiError(400, f"'{key}' must be strings or lists of token ids, not a mix or other types",
                   param=key, code="invalid_input")


def _optional_string(payload: dict, name: str) -> str | None:
    value = payload.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", param=name, code=f"invalid_{name}")
    return value


def _shape(vec, dims: int | None, normalize: bool):
    """The first dims values (Matryoshka), then unit length again when normalize. vec: a list of floats,
    or a float32 row of the engine process's answer (kept as it is: orjson writes it directly)."""
    if dims is not None:
        vec = vec[:dims]
    if normalize:
        if isinstance(vec, list):
            norm = math.sqrt(math.fsum(x * x for x in vec))
            if norm > 0:
                vec = [x / norm for x in vec]
        else:
            norm = math.sqrt(math.fsum(float(x) * float(x) for x in vec.tolist()))
            if norm > 0:
                vec = (vec / norm).astype(vec.dtype)
    return vec


def _query_prompt(payload) -> bool:
    """TEI's prompt_name: 'query' (the model's instruction) or absent; whether the inputs are queries."""
    prompt_name = payload.get("prompt_name")
    if prompt_name not in (None, "query"):
        raise ApiError(400, "prompt_name must be 'query' (the model's query instruction) or null",
                       param="prompt_name", code="invalid_prompt_name")
    return prompt_name == "query"


def _too_long(i: int, chars: int, limit: int, key: str, hint: str = "") -> ApiError:
    return ApiError(400, f"input {i} has {chars} characters, more than the maximum {limit}{hint}", param=key,
                    code="input_too_long")


def _untokenizable(key: str, exc: Exception) -> ApiError:
    return ApiError(400, f"'{key}' cannot be tokenized: {type(exc).__name__}", param=key, code="invalid_input")


def _too_many_tokens(limit: int, key: str) -> ApiError:
    return ApiError(400, f"the request has more than {limit} tokens in all; send fewer or shorter inputs",
                    param=key, code="request_too_large")


class EmbeddingService:
    """Request logic, independent of HTTP so tests can call it directly."""

    # The fields each route reads (openapi.json documents the same); the transport drops the others
    # right after parsing, so a large unknown field is not held for the request's life.
    OPENAI_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "input_type",
                               "truncate_prompt_tokens", "truncation_side", "user"})
    TEI_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "normalize", "dimensions", "prompt_name"})
    TOKENIZE_FIELDS = frozenset({"inputs", "add_special_tokens", "prompt_name"})
    DECODE_FIELDS = frozenset({"ids", "skip_special_tokens"})
    REQUEST_FIELDS = {"/v1/embeddings": OPENAI_FIELDS, "/embeddings": OPENAI_FIELDS, "/embed": TEI_FIELDS,
                      "/": TEI_FIELDS, "/tokenize": TOKENIZE_FIELDS, "/decode": DECODE_FIELDS}
    TEI_ROUTES = ("/embed", "/")

    def __init__(self, engine, limits: ServerLimits, metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.max_tokens = min(limits.max_input_tokens or engine.params.max_seq_len, engine.params.max_seq_len)
        self.max_chars = limits.max_input_chars or CHARS_PER_TOKEN * self.max_tokens
        self.model_names = limits.served_model_names or (engine.params.model_name or "mopt-embedding",)
        self.model_name = self.model_names[0]
        p = engine.params
        # A packed engine takes at most its own budget in one call: a larger one would only be cut again.
        budget = limits.max_batch_tokens
        self.max_batch_tokens = min(budget or p.batch_tokens, p.batch_tokens) if p.packed else budget
        self.batcher = Batcher(engine.embed_ids, limits.max_batch, limits.max_wait_ms, self.metrics,
                               max_queue_tokens=limits.max_queue_tokens, max_batch_tokens=self.max_batch_tokens,
                               ping_interval_s=limits.engine_ping_s, stall_timeout_s=limits.engine_stall_s,
                               submit=getattr(engine, "submit", None), depth=limits.engine_depth,
                               quiet_s=limits.batch_quiet_ms / 1000.0,
                               concurrent=getattr(engine, "concurrent_calls", False))
        self._failure_lock = threading.Lock()
        self._last_failure: BaseException | None = None  # logged already (one line per failed batch)

    # --- status routes ----------------------------------------------------------------------------

    def engine_alive(self) -> bool:
        alive = getattr(self.engine, "alive", None)
        return alive is None or bool(alive())

    def engine_stalled(self) -> float | None:
        """Seconds the engine's current call has run, once past its deadline (batcher.stalled)."""
        return self.batcher.stalled()

    def health(self) -> dict:
        if not self.engine_alive():
            raise ApiError(503, "the engine process has exited", code="engine_down")
        stalled = self.engine_stalled()
        if stalled is not None:
            raise ApiError(503, f"the engine has not answered for {stalled:.1f}s", code="engine_stalled")
        info, p = self.engine.info, self.engine.params
        return {"status": "ok", "model": self.model_name, "backend": info["backend"],
                "device": info["device"], "target_sm": info["target_sm"], "torch": info["torch"],
                "engine_sha256": info["engine_sha256"], "embedding_dim": self.engine.dim,
                "max_batch": p.max_batch, "max_seq_len": p.max_seq_len, "max_input_tokens": self.max_tokens,
                "pooling": p.pooling, "normalize": p.normalize, "image": info.get("image")}

    def models(self) -> dict:
        """OpenAI's GET /v1/models: the one model this server embeds with."""
        created = self.engine.info.get("created")
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created if type(created) is int else 0,
            "owned_by": "mopt", "max_model_len": self.max_tokens, "root": self.model_name}
            for name in self.model_names]}

    def matryoshka_range(self) -> list[int] | None:
        low = self.engine.params.matryoshka_min_dim
        return None if low is None else [min(low, self.engine.dim), self.engine.dim]

    def info(self) -> dict:
        """GET /info: the model, its limits and what it was built with."""
        info, p = self.engine.info, self.engine.params
        image = info.get("image")
        image = image if isinstance(image, dict) else None
        tei = {  # text-embeddings-inference's Info fields (its OpenAPI document), for its clients
            "model_id": self.model_name, "model_sha": info.get("model_digest"),
            "model_dtype": MODEL_DTYPES.get(p.precision, p.precision),
            "model_type": {"embedding": {"pooling": p.pooling}}, "max_input_length": self.max_tokens,
            "max_batch_tokens": self.max_batch_tokens or p.batch_tokens, "max_batch_requests": self.limits.max_batch,
            "max_client_batch_size": self.limits.max_inputs, "version": (image or {}).get("long_tag") or "unknown",
            "sha": None, "docker_label": (image or {}).get("tag"),
        }
        return {**tei, "model": self.model_name, "embedding_dim": self.engine.dim,
                "max_input_tokens": self.max_tokens, "max_input_chars": self.max_chars,
                "limits": {**asdict(self.limits), "served_model_names": list(self.model_names),
                           "max_input_tokens": self.max_tokens,
                           "max_input_chars": self.max_chars, "max_batch_tokens": self.max_batch_tokens},
                "backend": info.get("backend"), "backend_version": info.get("backend_version"),
                "torch": info.get("torch"), "device": info.get("device"), "target_sm": info.get("target_sm"),
                "engine_sha256": info.get("engine_sha256"), "image": image,
                "image_tag": image.get("tag") if isinstance(image, dict) else None,
                "matryoshka_dimensions": self.matryoshka_range(), "pooling": p.pooling,
                "normalize": p.normalize, "auto_truncate": self.limits.auto_truncate,
                "max_batch": p.max_batch, "max_seq_len": p.max_seq_len, "input_form": p.input_form}

    # --- embedding routes -------------------------------------------------------------------------

    def embeddings(self, payload, deadline: float | None = None, client_gone=None) -> tuple[dict, int]:
        """OpenAI's POST /v1/embeddings, with vLLM's truncate_prompt_tokens and an input_type extension."""
        return self.run(self.prepare_embeddings(payload), deadline, client_gone)

    def embed(self, payload, deadline: float | None = None, client_gone=None) -> tuple[list, int]:
        """TEI's POST /embed: {"inputs", "truncate", "truncation_direction", "normalize", "dimensions",
        "prompt_name"} -> a list of vectors. Errors in OpenAI's format (see the module docstring)."""
        return self.run(self.prepare_embed(payload), deadline, client_gone)

    def prepare(self, route: str, payload, known: dict[str, list[int]] | None = None) -> Work:
        """The request checked and tokenized, ready for the engine (no engine work yet). /tokenize and
        /decode need no engine: their Work has no sequences, and finish() makes the answer. known: token
        ids of some of its texts, tokenized already (TextEncoder.encode's known)."""
        if route == "/tokenize":
            return self.prepare_tokenize(payload)
        if route == "/decode":
            return self.prepare_decode(payload)
        if route in self.TEI_ROUTES:
            return self.prepare_embed(payload, known)
        return self.prepare_embeddings(payload, known)

    def texts_to_tokenize(self, route: str, payload) -> list[str]:
        """The texts prepare() would tokenize whole for this request, as far as a look tells: none where it
        would truncate or format them, or refuse the request before tokenizing. What tokenbatch.py may
        tokenize ahead (a text given here that prepare() does not take costs time, never a wrong answer)."""
        if not isinstance(payload, dict) or route not in self.REQUEST_FIELDS or route in ("/tokenize", "/decode"):
            return []
        tei = route in self.TEI_ROUTES
        value = payload.get("inputs" if tei else "input")
        texts = [value] if isinstance(value, str) else value
        if (not isinstance(texts, list) or len(texts) > self.limits.max_inputs
                or any(type(t) is not str or len(t) > self.max_chars for t in texts)):
            return []
        try:
            trunc = self._tei_truncation(payload) if tei else self._vllm_truncation(payload)
            query = _query_prompt(payload) if tei else payload.get("input_type") == "query"
        except ApiError:
            return []
        return [] if query or (trunc is not None and not trunc.whole) else texts

    def prepare_tokenize(self, payload) -> Work:
        """TEI's /tokenize: {"inputs": str | [str], "add_special_tokens": true, "prompt_name": null | "query"}
        -> per input its tokens {"id", "text", "special", "start", "stop"}, within the same limits as an
        embedding request (characters, then tokens)."""
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs, key="inputs")
        if are_ids:
            raise ApiError(400, "'inputs' must be strings for /tokenize", param="inputs", code="invalid_input")
        add = payload.get("add_special_tokens", True)
        if type(add) is not bool:
            raise ApiError(400, "add_special_tokens must be true or false", param="add_special_tokens",
                           code="invalid_add_special_tokens")
        query = _query_prompt(payload)
        enc = self.engine.encoder
        texts = []
        for i, text in enumerate(inputs):
            if len(text) > self.max_chars:
                raise _too_long(i, len(text), self.max_chars, "inputs")
            texts.append(enc.format_query(text) if query else text)
        try:
            rows = enc.tokens(texts, add)
        except (UnicodeError, ValueError, TypeError) as exc:
            raise _untokenizable("inputs", exc) from None
        total = sum(len(r) for r in rows)
        if total > self.limits.max_request_tokens:
            raise _too_many_tokens(self.limits.max_request_tokens, "inputs")

        def finish(_vectors) -> list:
            return [[{"id": tid, "text": text[start:stop] if start is not None else token, "special": special,
                      "start": start, "stop": stop} for tid, token, special, start, stop in row]
                    for text, row in zip(texts, rows, strict=True)]

        return Work([], 0, finish, answer_bytes=total * TOKEN_ANSWER_BYTES)

    def prepare_decode(self, payload) -> Work:
        """TEI's /decode: {"ids": [int] | [[int]], "skip_special_tokens": true} -> one string per list."""
        seqs, are_ids = parse_inputs(payload, self.limits.max_inputs, key="ids")
        vocab = self.engine.encoder.vocab_size
        if not are_ids or any(not 0 <= t < vocab for s in seqs for t in s):
            raise ApiError(400, f"'ids' must be token ids in 0..{vocab - 1}, or lists of them", param="ids",
                           code="invalid_input")
        if sum(len(s) for s in seqs) > self.limits.max_request_tokens:
            raise ApiError(400, f"the request has more than {self.limits.max_request_tokens} ids in all",
                           param="ids", code="request_too_large")
        skip = payload.get("skip_special_tokens", True)
        if type(skip) is not bool:
            raise ApiError(400, "skip_special_tokens must be true or false", param="skip_special_tokens",
                           code="invalid_skip_special_tokens")
        texts = self.engine.encoder.decode(seqs, skip)
        return Work([], 0, lambda _vectors: texts, answer_bytes=sum(len(t) for t in texts) * 4)

    def prepare_embeddings(self, payload, known: dict[str, list[int]] | None = None) -> Work:
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs)
        # One model: any name is served by it (clients send their own defaults); a served name or alias is
        # echoed in the response, any other gets the primary name. A string, as OpenAI's.
        asked = _optional_string(payload, "model")
        answer_name = asked if asked in self.model_names else self.model_name
        _optional_string(payload, "user")
        fmt = payload.get("encoding_format")
        fmt = "float" if fmt in (None, "") else fmt  # not `or`: false, 0 and {} are errors, not the default
        if fmt not in ("float", "base64"):
            raise ApiError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format",
                           code="invalid_encoding_format")
        dims = self._dimensions(payload)
        input_type = payload.get("input_type", "document")  # extension: "query" adds the instruction
        if input_type not in ("query", "document"):
            raise ApiError(400, "input_type must be 'query' or 'document'", param="input_type",
                           code="invalid_input_type")
        seqs = self._sequences(inputs, are_ids, input_type == "query", self._vllm_truncation(payload), "input", known)
        renormalize = dims is not None and self.engine.params.normalize
        tokens = sum(len(s) for s in seqs)

        def finish(vectors) -> dict:
            data = [{"object": "embedding", "index": i, "embedding": _encode(_shape(v, dims, renormalize), fmt)}
                    for i, v in enumerate(vectors)]
            return {"object": "list", "data": data, "model": answer_name,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

        return Work(seqs, tokens, finish)

    def prepare_embed(self, payload, known: dict[str, list[int]] | None = None) -> Work:
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs, key="inputs")
        normalize = payload.get("normalize")
        normalize = True if normalize is None else normalize  # TEI's default
        if type(normalize) is not bool:
            raise ApiError(400, "normalize must be true or false", param="normalize", code="invalid_normalize")
        if not normalize and self.engine.params.normalize:
            raise ApiError(400, "this engine was compiled with normalisation: its vectors are always unit "
                                "length, so normalize: false is not available", param="normalize",
                           code="unsupported_normalize")
        query = _query_prompt(payload)
        dims = self._dimensions(payload)
        seqs = self._sequences(inputs, are_ids, query, self._tei_truncation(payload), "inputs", known)
        # Unit length again after a Matryoshka cut, or at all when the engine leaves vectors as they are.
        renormalize = normalize and (dims is not None or not self.engine.params.normalize)

        def finish(vectors) -> list:
            return [_shape(v, dims, renormalize) for v in vectors]

        return Work(seqs, sum(len(s) for s in seqs), finish)

    def answer_bytes(self, work: Work) -> int:
        """An upper bound of the memory work's answer takes while it is written: per value, its float32 and
        its JSON text (a float32's shortest form, sign, exponent and comma: at most 16 characters)."""
        if work.answer_bytes is not None:
            return work.answer_bytes
        return len(work.seqs) * self.engine.dim * ANSWER_BYTES_PER_VALUE

    def run(self, work: Work, deadline: float | None = None, client_gone=None):
        """Blocking: submit, wait (in slices: a passed deadline or a gone client cancels it), finish.
        Returns (body, tokens). The HTTP server awaits submit()'s future instead."""
        return work.finish(self._run(work.seqs, deadline, client_gone)), work.tokens

    # --- request options --------------------------------------------------------------------------

    def _dimensions(self, payload) -> int | None:
        """The Matryoshka dimension asked for, or None for the full vector."""
        dims = payload.get("dimensions")
        if dims is None:
            return None
        full, valid = self.engine.dim, self.matryoshka_range()
        if type(dims) is not int:
            raise ApiError(400, "dimensions must be an integer", param="dimensions", code="invalid_dimensions")
        if valid is None:
            if dims != full:
                raise ApiError(400, f"this model does not support Matryoshka dimensions: it only produces {full} "
                                    "dimensions", param="dimensions", code="invalid_dimensions")
            return None
        if not valid[0] <= dims <= full:
            raise ApiError(400, f"dimensions must be in {valid[0]}..{full} for this model, got {dims}",
                           param="dimensions", code="invalid_dimensions")
        return None if dims == full else dims

    def _auto(self) -> Truncation | None:
        return Truncation(self.max_tokens, "right") if self.limits.auto_truncate else None

    def _vllm_truncation(self, payload) -> Truncation | None:
        """vLLM's truncate_prompt_tokens: k keeps k tokens, cut on the tokenizer's truncation_side (its
        tokenizer_config.json; right, keeping the start, by default) as vLLM's renderer has the tokenizer
        cut (older vLLM kept the last k); -1 the model's maximum. With vLLM's truncation_side the whole
        encoding is cut on that side, special tokens included (tests/integration/test_vllm_cpu.py holds
        both against vLLM's own server)."""
        k = payload.get("truncate_prompt_tokens")
        side = payload.get("truncation_side")
        if side not in (None, "left", "right"):
            raise ApiError(400, "truncation_side must be 'left' or 'right'", param="truncation_side",
                           code="invalid_truncation_side")
        if k is None:
            return self._auto()
        if type(k) is not int or not (k == -1 or 1 <= k <= self.max_tokens):
            raise ApiError(400, f"truncate_prompt_tokens must be -1 (the maximum, {self.max_tokens}) or in "
                                f"1..{self.max_tokens}", param="truncate_prompt_tokens",
                           code="invalid_truncate_prompt_tokens")
        k = self.max_tokens if k == -1 else k
        if side is not None:
            return Truncation(k, side, whole=True)
        return Truncation(k, getattr(self.engine.encoder, "truncation_side", "right"))

    def _tei_truncation(self, payload) -> Truncation | None:
        """TEI's truncate (bool; absent: the server's auto_truncate) and truncation_direction (default Right)."""
        truncate = payload.get("truncate")
        if truncate is not None and type(truncate) is not bool:
            raise ApiError(400, "truncate must be true or false", param="truncate", code="invalid_truncate")
        direction = payload.get("truncation_direction")
        direction = "Right" if direction in (None, "") else direction  # not `or`: false, 0 and {} are errors
        if direction not in ("Right", "Left", "right", "left"):
            raise ApiError(400, "truncation_direction must be 'Right' or 'Left'", param="truncation_direction",
                           code="invalid_truncation_direction")
        if truncate is None:
            return self._auto()
        return Truncation(self.max_tokens, direction.lower()) if truncate else None

    # --- inputs to token ids ----------------------------------------------------------------------

    def _sequences(self, inputs: list, are_ids: bool, query: bool, trunc: Truncation | None,
                   key: str, known: dict[str, list[int]] | None = None) -> list[list[int]]:
        """Token ids per input within the limits: characters first (before any tokenizing), then tokens
        per input and per request. key: the request's field, named as the errors' param."""
        enc = self.engine.encoder
        if are_ids:
            vocab = enc.vocab_size
            if any(t < 0 or t >= vocab for seq in inputs for t in seq):
                raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param=key, code="invalid_token_id")
            seqs = [cut(s, trunc.max_tokens, trunc.direction) for s in inputs] if trunc else inputs
            self._check_tokens(seqs, 0, 0, trunc, key)
            return seqs
        texts = []
        for i, text in enumerate(inputs):
            if len(text) > self.max_chars:
                if trunc is None:
                    raise _too_long(i, len(text), self.max_chars, key, "; ask for truncation or shorten it")
                # Cut at the character limit before the tokenizer sees it; the token cut follows.
                text = cut(text, self.max_chars, trunc.direction)
            texts.append(enc.format_query(text) if query else text)
        seqs: list[list[int]] = []
        total, start = 0, 0
        while start < len(texts):  # groups of about TOKENIZE_GROUP_CHARS characters
            end, chars = start, 0
            while end < len(texts) and (end == start or chars + len(texts[end]) <= TOKENIZE_GROUP_CHARS):
                chars += len(texts[end])
                end += 1
            group = self._tokenize(texts[start:end], trunc, key, query, known)
            total = self._check_tokens(group, start, total, trunc, key)
            seqs.extend(group)
            start = end
        return seqs

    def _tokenize(self, texts: list[str], trunc: Truncation | None, key: str = "input",
                  query: bool = False, known: dict[str, list[int]] | None = None) -> list[list[int]]:
        enc = self.engine.encoder
        try:
            if trunc is None:
                return enc.encode(texts, known=known)
            if trunc.whole:
                return [cut(ids, trunc.max_tokens, trunc.direction) for ids in enc.encode(texts, known=known)]
            prefix = enc.query_prefix if query and trunc.direction == "left" else ""
            if prefix:  # a left cut of a query keeps its instruction
                return enc.encode(texts, max_tokens=trunc.max_tokens, direction="left", keep_prefix=prefix)
            return enc.encode(texts, max_tokens=trunc.max_tokens, direction=trunc.direction)
        except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate in the text
            raise _untokenizable(key, exc) from None

    def _check_tokens(self, seqs, first: int, total: int, trunc: Truncation | None, key: str = "input") -> int:
        """Per-input and per-request token limits for seqs (inputs first.. of the request); returns the
        request's running token total."""
        limit = trunc.max_tokens if trunc else self.max_tokens
        for i, s in enumerate(seqs, first):
            if len(s) > limit:
                raise ApiError(400, f"input {i} has {len(s)} tokens, more than the maximum {limit}",
                               param=key, code="context_length_exceeded")
            total += len(s)
        if total > self.limits.max_request_tokens:
            raise _too_many_tokens(self.limits.max_request_tokens, key)
        return total

    # --- the engine -------------------------------------------------------------------------------

    def submit(self, seqs: list[list[int]], deadline: float, client_gone=None):
        """Queue the work; its concurrent Future gets the vectors. A full queue is a 503 with Retry-After."""
        try:
            return self.batcher.submit(seqs, deadline, client_gone)
        except QueueFull as full:
            self.metrics.request_dropped("queue_full")
            raise ApiError(503, f"the server is busy (its queue is full); retry after {full.retry_after}s",
                           code="queue_full", headers={"Retry-After": str(full.retry_after)}) from None

    def failure(self, exc: BaseException) -> ApiError:
        """The ApiError for a future that failed: dropped from the queue, or an engine failure."""
        if isinstance(exc, Dropped):
            return self._dropped(exc.reason)
        return self._engine_failed(exc)

    def _run(self, seqs: list[list[int]], deadline: float | None, client_gone) -> list[list[float]]:
        """Queue the work and wait for it, in slices: a passed deadline or a gone client cancels it."""
        if deadline is None:
            deadline = time.monotonic() + self.limits.request_timeout_s
        fut = self.submit(seqs, deadline, client_gone)
        while True:
            try:
                return fut.result(timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except TimeoutError:
                pass
            except Exception as exc:  # noqa: BLE001  (dropped, or the engine failed this batch)
                raise self.failure(exc) from None
            if time.monotonic() >= deadline:
                reason = "timeout"
            elif client_gone is not None and client_gone():
                reason = "client_gone"
            else:
                continue
            fut.cancel()  # the batcher drops it before its next batch; chunks in flight finish unused
            raise self._dropped(reason)

    def _engine_failed(self, exc: Exception) -> ApiError:
        """The engine call behind this request failed: every request of the batch gets this, so it is
        logged once per failure, not with a traceback per request. A dead worker is a 503 (the watchdog
        stops the server; another replica can answer), anything else a 500."""
        if not self.engine_alive():
            return ApiError(503, "the engine process has exited", code="engine_down")
        with self._failure_lock:
            if exc is not self._last_failure:
                self._last_failure = exc
                log.error("an engine call failed: %s: %s", type(exc).__name__, exc)
        return ApiError(500, f"the engine failed this batch: {type(exc).__name__}", code="engine_error")

    def _dropped(self, reason: str) -> ApiError:
        self.metrics.request_dropped(reason)
        if reason == "timeout":
            return ApiError(503, "timed out waiting for the engine", code="timeout")
        if reason == "shutdown":
            return ApiError(503, "the server is shutting down; retry on another replica", code="shutting_down",
                            headers={"Retry-After": "1", "Connection": "close"})
        if reason == "engine_down":
            return ApiError(503, "the engine stopped; the server is restarting", code="engine_down",
                            headers={"Connection": "close"})
        # 499 (nginx's "client closed request"): never sent, the client is gone; logged and counted.
        return ApiError(499, "the client closed the connection", code="client_closed_request")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the batcher and the engine; timeout bounds each wait (the calls in flight, the worker's exit)."""
        self.batcher.close(timeout)
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine(timeout)


def _encode(vec, fmt: str):
    if fmt == "base64":  # OpenAI's base64: little-endian float32
        raw = vec.astype("<f4").tobytes() if hasattr(vec, "astype") else struct.pack(f"<{len(vec)}f", *vec)
        return base64.b64encode(raw).decode()
    return vec
