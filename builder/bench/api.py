"""The two embeddings APIs a bench target may speak: OpenAI's POST /v1/embeddings (mopt, vLLM,
infinity, TEI too) and TEI's POST /embed. A body is made once per request of the workload; every
answer is checked (status, JSON, one vector per text, one dimension), so a server that answers
wrongly is counted as such, never as fast."""
from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass

from ..errors import clipped

try:  # parsing answers is most of the load generator's work: orjson where it is installed (runtime extra)
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - the standard library is the fallback
    _loads = json.loads

APIS = ("openai", "tei")
ENCODINGS = ("float", "base64")


class BadAnswer(ValueError):
    """An answer that is not the embeddings response it should be (the message says what is wrong)."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+")


def printable(data: bytes | str, limit: int = 200) -> str:
    """A server's text as one safe line: control characters (terminal escapes, newlines) as spaces, clipped."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return clipped(" ".join(_CONTROL.sub(" ", text).split()), limit)


@dataclass(frozen=True)
class Api:
    name: str  # openai | tei
    path: str

    def body(self, texts: list[str], model: str | None, encoding: str) -> bytes:
        """A request's body. ENCODING base64 (OpenAI's API only) is what OpenAI's own Python client asks for:
        vectors as base64 of float32, about a fifth of the bytes of JSON numbers."""
        if self.name == "tei":
            return json.dumps({"inputs": texts}).encode()
        return json.dumps({"input": texts} | ({"model": model} if model else {})
                          | ({"encoding_format": "base64"} if encoding == "base64" else {})).encode()

    def check(self, data: bytes, texts: int, headers) -> tuple[int, int | None]:
        """The answer's (dimension, tokens or None), or BadAnswer naming what is wrong."""
        try:
            payload = _loads(data)
        except ValueError:
            raise BadAnswer(f"not JSON: {printable(data[:120])!r}") from None
        if self.name == "tei":
            vectors = payload
            tokens = _int(headers.get("x-compute-tokens"))
        else:
            vectors = payload.get("data") if isinstance(payload, dict) else None
            if isinstance(vectors, list) and all(isinstance(item, dict) for item in vectors):
                vectors = [_vector(item.get("embedding")) for item in vectors]
            usage = payload.get("usage") if isinstance(payload, dict) else None
            tokens = _int(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
        if not isinstance(vectors, list) or len(vectors) != texts:
            got = f"{len(vectors)} vectors" if isinstance(vectors, list) else type(vectors).__name__
            raise BadAnswer(f"{got} for {texts} texts")
        dimensions = {len(v) if isinstance(v, list) else -1 for v in vectors}
        if len(dimensions) != 1 or -1 in dimensions or 0 in dimensions:
            raise BadAnswer(f"vectors of sizes {sorted(dimensions)[:4]}, not one dimension")
        # The first element of every vector (checking every number would make the client the bottleneck).
        if not all(isinstance(v[0], (int, float)) and not isinstance(v[0], bool) for v in vectors):
            raise BadAnswer("a vector holds something other than numbers")
        return dimensions.pop(), tokens


def _vector(value):
    """An OpenAI embedding as a list: a base64 one decoded (float32, little-endian) only to its length."""
    if not isinstance(value, str):
        return value
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadAnswer("an embedding is a string but not base64") from None
    if len(raw) % 4:
        raise BadAnswer(f"a base64 embedding of {len(raw)} bytes, not whole float32 values")
    return [0.0] * (len(raw) // 4)


def _int(value) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number >= 0 else None


OPENAI = Api("openai", "/v1/embeddings")
TEI = Api("tei", "/embed")
BY_NAME = {api.name: api for api in (OPENAI, TEI)}
