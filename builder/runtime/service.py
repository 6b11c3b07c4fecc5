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

log = logging.getLogger(__name__)

# max_input_chars when unset: characters per token allowed, times the token limit. Prose averages
# 3-5 characters per WordPiece/BPE token; 8 leaves room for code, URLs and long words while keeping
# the text handed to the tokenizer (which costs hundreds of bytes per character while it encodes)
# proportional to what the engine can take, instead of the whole 4 MiB body.
CHARS_PER_TOKEN = 8
# Characters per tokenizer call: a request is encoded in groups of about this many characters,
# checking the token limits after each, so its peak memory stays bounded by one group.
TOKENIZE_GROUP_CHARS = 1 << 18
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
    max_inputs: int = 256  # inputs per request
    max_input_tokens: int | None = None  # tokens per input; None: the engine's max_seq_len (also the ceiling)
    max_body_bytes: int = 4 * 1024 * 1024  # request body (the transport enforces it)
    request_timeout_s: float = 120.0  # whole-request deadline when the transport passes none
    # Characters per input, checked before tokenizing; None: CHARS_PER_TOKEN * the token limit.
    max_input_chars: int | None = None
    # Tokens per request, all inputs together, after truncation: 256 inputs of 512 tokens (the default
    # max_inputs at a BERT-size context) fit; a long-context model cannot take more than this much
    # engine time (and queue memory, ~40 bytes a token) from one request.
    max_request_tokens: int = 131072
    # Tokens waiting for the engine, all requests together; beyond it 503 + Retry-After. Two full
    # requests: enough to keep the engine busy, while a queued request's wait stays bounded.
    # An empty queue takes any request that passed max_request_tokens.
    max_queue_tokens: int = 262144
    # Truncate over-long inputs when a request does not say. Off: a silent cut changes the embedding
    # without telling the client, so over-long input is a 400 unless asked for (TEI's default too).
    auto_truncate: bool = False

    def __post_init__(self) -> None:
        for name in ("max_request_tokens", "max_queue_tokens", "max_input_chars", "max_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise UsageError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")


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
class Truncation:
    max_tokens: int
    direction: str  # "right": keep the start; "left": keep the end


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


def _optional_string(payload: dict, name: str) -> None:
    value = payload.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string", param=name, code=f"invalid_{name}")


def _cut(seq, n: int, direction: str):
    return seq[:n] if direction == "right" else seq[len(seq) - n:]


def _shape(vec: list[float], dims: int | None, normalize: bool) -> list[float]:
    """The first dims values (Matryoshka), then unit length again when normalize."""
    if dims is not None:
        vec = vec[:dims]
    if normalize:
        norm = math.sqrt(math.fsum(x * x for x in vec))
        if norm > 0:
            vec = [x / norm for x in vec]
    return vec


class EmbeddingService:
    """Request logic, independent of HTTP so tests can call it directly."""

    # The fields each route reads (openapi.json documents the same); the transport drops the others
    # right after parsing, so a large unknown field is not held for the request's life.
    OPENAI_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "input_type",
                               "truncate_prompt_tokens", "user"})
    TEI_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "normalize", "dimensions", "prompt_name"})
    REQUEST_FIELDS = {"/v1/embeddings": OPENAI_FIELDS, "/embeddings": OPENAI_FIELDS, "/embed": TEI_FIELDS}

    def __init__(self, engine, limits: ServerLimits, metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.max_tokens = min(limits.max_input_tokens or engine.params.max_seq_len, engine.params.max_seq_len)
        self.max_chars = limits.max_input_chars or CHARS_PER_TOKEN * self.max_tokens
        self.model_name = engine.params.model_name or "mopt-embedding"
        p = engine.params
        # A packed engine takes at most its own budget in one call: a larger one would only be cut again.
        budget = limits.max_batch_tokens
        self.max_batch_tokens = min(budget or p.batch_tokens, p.batch_tokens) if p.packed else budget
        self.batcher = Batcher(engine.embed_ids, limits.max_batch, limits.max_wait_ms, self.metrics,
                               max_queue_tokens=limits.max_queue_tokens, max_batch_tokens=self.max_batch_tokens)
        self._failure_lock = threading.Lock()
        self._last_failure: BaseException | None = None  # logged already (one line per failed batch)

    # --- status routes ----------------------------------------------------------------------------

    def engine_alive(self) -> bool:
        alive = getattr(self.engine, "alive", None)
        return alive is None or bool(alive())

    def health(self) -> dict:
        if not self.engine_alive():
            raise ApiError(503, "the engine process has exited", code="engine_down")
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
            "id": self.model_name, "object": "model", "created": created if type(created) is int else 0,
            "owned_by": "mopt", "max_model_len": self.max_tokens}]}

    def matryoshka_range(self) -> list[int] | None:
        low = self.engine.params.matryoshka_min_dim
        return None if low is None else [min(low, self.engine.dim), self.engine.dim]

    def info(self) -> dict:
        """GET /info: the model, its limits and what it was built with."""
        info, p = self.engine.info, self.engine.params
        image = info.get("image")
        return {"model": self.model_name, "embedding_dim": self.engine.dim,
                "max_input_tokens": self.max_tokens, "max_input_chars": self.max_chars,
                "limits": {**asdict(self.limits), "max_input_tokens": self.max_tokens,
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
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs)
        _optional_string(payload, "model")  # accepted and ignored (one model), but a string as OpenAI's
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
        seqs = self._sequences(inputs, are_ids, input_type == "query", self._vllm_truncation(payload), "input")
        vectors = self._run(seqs, deadline, client_gone)
        renormalize = dims is not None and self.engine.params.normalize
        tokens = sum(len(s) for s in seqs)
        data = [{"object": "embedding", "index": i, "embedding": _encode(_shape(v, dims, renormalize), fmt)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, tokens

    def embed(self, payload, deadline: float | None = None, client_gone=None) -> tuple[list, int]:
        """TEI's POST /embed: {"inputs", "truncate", "truncation_direction", "normalize", "dimensions",
        "prompt_name"} -> a list of vectors. Errors in OpenAI's format (see the module docstring)."""
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs, key="inputs")
        normalize = payload.get("normalize")
        normalize = True if normalize is None else normalize  # TEI's default
        if type(normalize) is not bool:
            raise ApiError(400, "normalize must be true or false", param="normalize", code="invalid_normalize")
        if not normalize and self.engine.params.normalize:
            raise ApiError(400, "this engine was compiled with normalisation: its vectors are always unit "
                                "length, so normalize: false is not available", param="normalize",
                           code="unsupported_normalize")
        prompt_name = payload.get("prompt_name")
        if prompt_name not in (None, "query"):
            raise ApiError(400, "prompt_name must be 'query' (the model's query instruction) or null",
                           param="prompt_name", code="invalid_prompt_name")
        dims = self._dimensions(payload)
        seqs = self._sequences(inputs, are_ids, prompt_name == "query", self._tei_truncation(payload), "inputs")
        vectors = self._run(seqs, deadline, client_gone)
        # Unit length again after a Matryoshka cut, or at all when the engine leaves vectors as they are.
        renormalize = normalize and (dims is not None or not self.engine.params.normalize)
        tokens = sum(len(s) for s in seqs)
        return [_shape(v, dims, renormalize) for v in vectors], tokens

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
        """vLLM's truncate_prompt_tokens: k keeps the last k tokens (left truncation); -1 the model's maximum."""
        k = payload.get("truncate_prompt_tokens")
        if k is None:
            return self._auto()
        if type(k) is not int or not (k == -1 or 1 <= k <= self.max_tokens):
            raise ApiError(400, f"truncate_prompt_tokens must be -1 (the maximum, {self.max_tokens}) or in "
                                f"1..{self.max_tokens}", param="truncate_prompt_tokens",
                           code="invalid_truncate_prompt_tokens")
        return Truncation(self.max_tokens if k == -1 else k, "left")

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
                   key: str) -> list[list[int]]:
        """Token ids per input within the limits: characters first (before any tokenizing), then tokens
        per input and per request. key: the request's field, named as the errors' param."""
        enc = self.engine.encoder
        if are_ids:
            vocab = enc.vocab_size
            if any(t < 0 or t >= vocab for seq in inputs for t in seq):
                raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param=key, code="invalid_token_id")
            seqs = [_cut(s, trunc.max_tokens, trunc.direction) for s in inputs] if trunc else inputs
            self._check_tokens(seqs, 0, 0, trunc, key)
            return seqs
        texts = []
        for i, text in enumerate(inputs):
            if len(text) > self.max_chars:
                if trunc is None:
                    raise ApiError(400, f"input {i} has {len(text)} characters, more than the maximum "
                                        f"{self.max_chars}; ask for truncation or shorten it", param=key,
                                   code="input_too_long")
                # Cut at the character limit before the tokenizer sees it; the token cut follows.
                text = _cut(text, self.max_chars, trunc.direction)
            texts.append(enc.format_query(text) if query else text)
        seqs: list[list[int]] = []
        total, start = 0, 0
        while start < len(texts):  # groups of about TOKENIZE_GROUP_CHARS characters
            end, chars = start, 0
            while end < len(texts) and (end == start or chars + len(texts[end]) <= TOKENIZE_GROUP_CHARS):
                chars += len(texts[end])
                end += 1
            group = self._tokenize(texts[start:end], trunc, key, query)
            total = self._check_tokens(group, start, total, trunc, key)
            seqs.extend(group)
            start = end
        return seqs

    def _tokenize(self, texts: list[str], trunc: Truncation | None, key: str = "input",
                  query: bool = False) -> list[list[int]]:
        enc = self.engine.encoder
        try:
            if trunc is None:
                return enc.encode(texts)
            prefix = enc.query_prefix if query and trunc.direction == "left" else ""
            if prefix:  # a left cut of a query keeps its instruction
                return enc.encode(texts, max_tokens=trunc.max_tokens, direction="left", keep_prefix=prefix)
            return enc.encode(texts, max_tokens=trunc.max_tokens, direction=trunc.direction)
        except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate in the text
            raise ApiError(400, f"'{key}' cannot be tokenized: {type(exc).__name__}", param=key,
                           code="invalid_input") from None

    def _check_tokens(self, seqs, first: int, total: int, trunc: Truncation | None, key: str = "input") -> int:
        """Per-input and per-request token limits for seqs (inputs first.. of the request); returns the
        request's running token total."""
        limit = trunc.max_tokens if trunc else self.max_tokens
        for i, s in enumerate(seqs, first):
            if len(s) > limit:
                if trunc:  # only when the model's special tokens alone exceed a tiny truncate_prompt_tokens
                    raise ApiError(400, f"input {i} has {len(s)} tokens after truncation to {limit} (the "
                                        "model's special tokens do not fit)", param=key,
                                   code="context_length_exceeded")
                raise ApiError(400, f"input {i} has {len(s)} tokens, more than the maximum {limit}",
                               param=key, code="context_length_exceeded")
            total += len(s)
        if total > self.limits.max_request_tokens:
            raise ApiError(400, f"the request has more than {self.limits.max_request_tokens} tokens in all; "
                                "send fewer or shorter inputs", param=key, code="request_too_large")
        return total

    # --- the engine -------------------------------------------------------------------------------

    def _run(self, seqs: list[list[int]], deadline: float | None, client_gone) -> list[list[float]]:
        """Queue the work and wait for it, in slices: a passed deadline or a gone client cancels it."""
        if deadline is None:
            deadline = time.monotonic() + self.limits.request_timeout_s
        try:
            fut = self.batcher.submit(seqs, deadline, client_gone)
        except QueueFull as full:
            self.metrics.request_dropped("queue_full")
            raise ApiError(503, f"the server is busy (its queue is full); retry after {full.retry_after}s",
                           code="queue_full", headers={"Retry-After": str(full.retry_after)}) from None
        while True:
            try:
                return fut.result(timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
            except TimeoutError:
                pass
            except Dropped as dropped:  # the batcher found the deadline passed or the client gone
                raise self._dropped(dropped.reason) from None
            except Exception as exc:  # noqa: BLE001  (the engine failed this batch)
                raise self._engine_failed(exc) from None
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
        # 499 (nginx's "client closed request"): never sent, the client is gone; logged and counted.
        return ApiError(499, "the client closed the connection", code="client_closed_request")

    def close(self) -> None:
        self.batcher.close()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()


def _encode(vec: list[float], fmt: str):
    if fmt == "base64":  # OpenAI's base64: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec
