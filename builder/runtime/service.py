"""Request logic of the embeddings server, apart from HTTP: limits, input validation, the
OpenAI/TEI request shapes, and the batcher in front of the engine. Tests call it directly."""
from __future__ import annotations

import base64
import struct
from dataclasses import dataclass

from .batcher import Batcher
from .metrics import Metrics


@dataclass(frozen=True)
class ServerLimits:
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_inputs: int = 256
    max_input_tokens: int | None = None  # None: the engine's max_seq_len
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 120.0


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def parse_inputs(payload, max_inputs: int) -> tuple[list, bool]:
    """Return (inputs, are_token_ids). Accepts a string, a list of strings, a list of token ids,
    or a list of token-id lists, as OpenAI does."""
    if not isinstance(payload, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_body")
    if "input" not in payload:
        raise ApiError(400, "'input' is required", param="input", code="missing_input")
    raw = payload["input"]
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(type(x) is int for x in raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'input' must be a non-empty string or a non-empty list", param="input",
                       code="invalid_input")
    if len(raw) > max_inputs:
        raise ApiError(400, f"too many inputs: {len(raw)} > {max_inputs}", param="input",
                       code="too_many_inputs")
    if all(isinstance(x, str) for x in raw):
        if any(not x for x in raw):
            raise ApiError(400, "'input' contains an empty string", param="input", code="empty_input")
        return raw, False
    if all(isinstance(x, list) and x and all(type(t) is int for t in x) for x in raw):
        return raw, True
    raise ApiError(400, "'input' must be strings or lists of token ids, not a mix or other types",
                   param="input", code="invalid_input")


class EmbeddingService:
    """Request logic, independent of HTTP so tests can call it directly."""

    def __init__(self, engine, limits: ServerLimits, metrics: Metrics | None = None):
        self.engine = engine
        self.limits = limits
        self.metrics = metrics or Metrics()
        self.max_tokens = min(limits.max_input_tokens or engine.params.max_seq_len, engine.params.max_seq_len)
        self.model_name = engine.params.model_name or "mopt-embedding"
        self.batcher = Batcher(engine.embed_ids, limits.max_batch, limits.max_wait_ms, self.metrics)

    def health(self) -> dict:
        alive = getattr(self.engine, "alive", None)
        if alive is not None and not alive():
            raise ApiError(503, "the engine process has exited", code="engine_down")
        info, p = self.engine.info, self.engine.params
        return {"status": "ok", "model": self.model_name, "backend": info["backend"],
                "device": info["device"], "target_sm": info["target_sm"], "torch": info["torch"],
                "engine_sha256": info["engine_sha256"], "embedding_dim": self.engine.dim,
                "max_batch": p.max_batch, "max_seq_len": p.max_seq_len, "max_input_tokens": self.max_tokens,
                "pooling": p.pooling, "normalize": p.normalize, "image": info.get("image")}

    def embeddings(self, payload) -> tuple[dict, int]:
        inputs, are_ids = parse_inputs(payload, self.limits.max_inputs)
        fmt = payload.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise ApiError(400, "encoding_format must be 'float' or 'base64'", param="encoding_format",
                           code="invalid_encoding_format")
        dims = payload.get("dimensions")
        if dims is not None and dims != self.engine.dim:
            raise ApiError(400, f"this model only produces {self.engine.dim} dimensions",
                           param="dimensions", code="invalid_dimensions")
        input_type = payload.get("input_type", "document")  # extension: "query" adds the instruction
        if input_type not in ("query", "document"):
            raise ApiError(400, "input_type must be 'query' or 'document'", param="input_type",
                           code="invalid_input_type")
        enc = self.engine.encoder
        if are_ids:
            vocab = enc.vocab_size
            if any(t < 0 or t >= vocab for seq in inputs for t in seq):
                raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="input",
                               code="invalid_token_id")
            seqs = inputs
        else:
            texts = [enc.format_query(t) for t in inputs] if input_type == "query" else inputs
            try:
                seqs = enc.encode(texts)
            except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate in the text
                raise ApiError(400, f"'input' cannot be tokenized: {type(exc).__name__}", param="input",
                               code="invalid_input") from None
        for i, s in enumerate(seqs):
            if len(s) > self.max_tokens:
                raise ApiError(400, f"input {i} has {len(s)} tokens, more than the maximum {self.max_tokens}",
                               param="input", code="context_length_exceeded")
        try:
            vectors = self.batcher.submit(seqs).result(timeout=self.limits.request_timeout_s)
        except TimeoutError:
            raise ApiError(503, "timed out waiting for the engine", code="timeout") from None
        tokens = sum(len(s) for s in seqs)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, tokens

    def close(self) -> None:
        self.batcher.close()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()


def _encode(vec: list[float], fmt: str):
    if fmt == "base64":  # OpenAI's base64: little-endian float32
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec
