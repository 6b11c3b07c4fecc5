"""The bench workload: what each request holds, made the same from the same spec on any host.

A workload is a spec (text lengths, texts per request, seed) from which the request texts are drawn
with a fixed seed; its sha256 over the drawn texts is written to the result, so `--workload FILE`
repeats a run exactly and says so when this mopt would draw something else. Lengths are in words
of a list of common English words (most are one token in BERT's, Qwen's and XLM-R's vocabularies);
the tokens a server really saw come back in its answers (OpenAI's usage, TEI's x-compute-tokens).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError, clipped

WORDS = tuple(("the quick brown fox jumps over a lazy dog while engineers ship inference images built for "
               "graphics processors serving embeddings of documents queries and code to users around the world "
               "with tokenizers batching padding attention pooling and caching on every machine they run").split())

MAX_WORDS = 8192  # per text: far past any embedding model's context, short of a memory problem
MAX_BATCH = 2048  # texts per request
MAX_DISTINCT = 4096  # distinct requests drawn (a run cycles through them)
MAX_FILE_BYTES = 64 * 1024 * 1024  # a file:PATH of texts
MAX_WORKLOAD_BYTES = 16 * 1024 * 1024  # a --workload file (an earlier bench.json)
MAX_TOTAL_WORDS = 1 << 25  # distinct x batch x max_words: about 200 MB of drawn text at most
SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_SIGMA = 3.0
DEFAULT_SIGMA = 0.8


@dataclass(frozen=True)
class Lengths:
    """How long each text is: `fixed:N`, `lognormal:MEDIAN[:SIGMA]` or `file:PATH` (lines of the user's text)."""

    kind: str  # fixed | lognormal | file
    words: int = 0  # fixed: every text; lognormal: the median
    sigma: float = 0.0
    path: str = ""

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, _, rest = text.partition(":")
        usage = "use fixed:N, lognormal:MEDIAN[:SIGMA] or file:PATH"
        if kind == "file":
            if not rest:
                raise ConfigError(f"--lengths 'file:': no path after file:; {usage}")
            return cls("file", path=rest)
        parts = rest.split(":")
        try:
            if kind == "fixed" and len(parts) == 1:
                return cls("fixed", words=_words(int(parts[0]))).checked()
            if kind == "lognormal" and len(parts) in (1, 2):
                sigma = float(parts[1]) if len(parts) == 2 else DEFAULT_SIGMA
                return cls("lognormal", words=_words(int(parts[0])), sigma=sigma).checked()
        except ValueError as exc:
            raise ConfigError(f"--lengths {clipped(text, 80)!r}: {exc}; {usage}") from None
        raise ConfigError(f"--lengths {clipped(text, 80)!r}: {usage}")

    def checked(self) -> Lengths:
        if self.kind == "lognormal" and not (0 < self.sigma <= MAX_SIGMA and math.isfinite(self.sigma)):
            raise ValueError(f"sigma must be in (0, {MAX_SIGMA}]")
        return self

    def __str__(self) -> str:
        return {"fixed": f"fixed:{self.words}", "lognormal": f"lognormal:{self.words}:{self.sigma:g}",
                "file": f"file:{self.path}"}[self.kind]


def _words(n: int) -> int:
    if not 1 <= n <= MAX_WORDS:
        raise ValueError(f"a length must be 1..{MAX_WORDS} words")
    return n


@dataclass(frozen=True)
class Workload:
    lengths: Lengths
    batch: int = 8  # texts per request
    max_words: int = 128  # a drawn length (or a file's line) is cut to this many words
    distinct: int = 256  # distinct requests drawn; a run sends them in turn, cycling
    seed: int = 0

    def __post_init__(self):
        for name, value, top in (("--batch", self.batch, MAX_BATCH), ("--max-words", self.max_words, MAX_WORDS),
                                 ("distinct requests", self.distinct, MAX_DISTINCT)):
            if not 1 <= value <= top:
                raise ConfigError(f"{name} must be 1..{top}, got {value}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"--seed must be 0..2^63-1, got {self.seed}")
        # Each bound alone is not a bound on the whole: the texts drawn are distinct x batch, each up to max_words.
        total = self.distinct * self.batch * self.max_words
        if total > MAX_TOTAL_WORDS:
            raise ConfigError(f"{self.distinct} requests x --batch {self.batch} x --max-words {self.max_words} = "
                              f"{total:,} words to draw, more than {MAX_TOTAL_WORDS:,}: lower --batch or --max-words")

    def requests(self) -> list[list[str]]:
        """DISTINCT requests of BATCH texts each, drawn with SEED: the same on every host."""
        rng = random.Random(self.seed)
        lines = _file_lines(Path(self.lengths.path)) if self.lengths.kind == "file" else []
        texts = []
        for _ in range(self.distinct * self.batch):
            if lines:
                words = rng.choice(lines).split()[:self.max_words]
                texts.append(" ".join(words))
                continue
            n = self.lengths.words
            if self.lengths.kind == "lognormal":
                n = round(math.exp(rng.gauss(math.log(n), self.lengths.sigma)))
            n = max(1, min(n, self.max_words))
            texts.append(" ".join(rng.choice(WORDS) for _ in range(n)))
        return [texts[i:i + self.batch] for i in range(0, len(texts), self.batch)]

    def to_json(self, requests: list[list[str]]) -> dict:
        """The spec and what it drew: a run reads this back (`--workload`) and draws the same."""
        words = sorted(len(text.split()) for batch in requests for text in batch)
        data = asdict(self) | {"lengths": str(self.lengths), "sha256": digest(requests),
                               "words": {"min": words[0], "median": words[len(words) // 2], "max": words[-1],
                                         "mean": round(sum(words) / len(words), 1)}}
        if self.lengths.kind == "file":
            data["file_sha256"] = hashlib.sha256(read_regular(Path(self.lengths.path), MAX_FILE_BYTES,
                                                              "--lengths file:")).hexdigest()
        return data

    @classmethod
    def from_json(cls, path: Path) -> tuple[Workload, str]:
        """The workload an earlier result (bench.json) or workload file names, and its sha256. The sha256 is
        required: it is what makes a shared file safe to run (a spec naming file:/etc/... draws nothing
        unless its texts hash to what the file says, which only someone who has them can write)."""
        where = f"--workload {path}"
        try:
            data = json.loads(read_regular(path, MAX_WORKLOAD_BYTES, "--workload "), parse_constant=_no_constant)
            spec = data.get("workload", data)
            numbers = {name: spec[name] for name in ("batch", "max_words", "distinct", "seed")}
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers.values()):
                raise ValueError(f"batch, max_words, distinct and seed must be integers: {numbers}")
            sha = spec["sha256"]
            if not isinstance(sha, str) or not SHA256.fullmatch(sha):
                raise ValueError("its sha256 of the drawn texts is missing or not 64 hex digits")
            workload = cls(lengths=Lengths.parse(str(spec["lengths"])), **numbers)
            return workload, sha
        except (UnicodeDecodeError, RecursionError) as exc:  # messages of their own making, short
            raise ConfigError(f"{where}: cannot read it as JSON: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{where}: not a mopt bench result or workload: {clipped(str(exc), 160)}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a workload can hold")


def read_regular(path: Path, limit: int, what: str) -> bytes:
    """PATH's bytes: a regular file of at most LIMIT bytes (not a device, FIFO or directory), else one line."""
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ConfigError(f"{what}{path}: not a regular file")
            data = handle.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what}{path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise ConfigError(f"{what}{path}: more than {limit} bytes")
    return data


def digest(requests: list[list[str]]) -> str:
    return hashlib.sha256(json.dumps(requests, ensure_ascii=False).encode()).hexdigest()


def _file_lines(path: Path) -> list[str]:
    try:
        text = read_regular(path, MAX_FILE_BYTES, "--lengths file:").decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--lengths file:{path}: cannot read it as UTF-8 text: {exc}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"--lengths file:{path}: no non-empty line to send")
    return lines
