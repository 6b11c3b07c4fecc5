"""mopt bench, start to end: each target in turn (the host's load sampled before and after), its API
found and checked with one strict request, a warm-up, the closed-loop runs, the open-loop runs, and
the sweep; then the result (JSON, table, chart). A target that fails is recorded with its one-line
reason and the others still run; the command then exits 10."""
from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from .. import __version__
from ..errors import BenchError, ConfigError, MoptError
from . import hostload
from .api import BY_NAME, ENCODINGS, OPENAI, TEI, Api, BadAnswer, printable
from .load import Load, Run
from .progress import Progress
from .sweep import MAX_STEPS, Sweep, sweep
from .target import GPUS, Image, Started, Target
from .workload import Lengths, Workload, digest

API_CHOICES = ("auto", *BY_NAME)
MAX_CLIENTS = 1024
MAX_RATE = 10_000.0
MAX_DURATION_S = 600.0
MAX_REQUESTS = 1_000_000
MAX_IN_FLIGHT = 4096
MAX_RUNS = 32  # per target: closed + open runs + sweep steps
MAX_TARGETS = 16
CLIENT_CPU_WARN = 0.8  # of one core: past it, the client (one event loop) may limit what is measured


@dataclass(frozen=True)
class Settings:
    """How each target is loaded; every figure bounded (ConfigError, exit 2, otherwise)."""

    clients: tuple[int, ...] = (8,)
    rates: tuple[float, ...] = ()
    sweep_p99_ms: float | None = None
    sweep_steps: int = 6
    duration_s: float = 10.0
    max_requests: int = 100_000
    warmup: int = 8
    timeout_s: float = 60.0
    max_in_flight: int = 256
    api: str = "auto"
    encoding: str = "float"  # OpenAI's encoding_format: float or base64
    model: str | None = None
    gpus: str = "auto"
    start_timeout_s: float = 300.0
    api_key: str | None = field(default=None, repr=False)  # never written to the result

    def __post_init__(self):
        def bound(name: str, value, low, high) -> None:
            if not low <= value <= high:
                raise ConfigError(f"{name} must be {low}..{high}, got {value}")

        if not self.clients and not self.rates and self.sweep_p99_ms is None:
            raise ConfigError("nothing to run: give --clients, --rate or --sweep-p99")
        for clients in self.clients:
            bound("--clients", clients, 1, MAX_CLIENTS)
        for rate in self.rates:
            if not 0 < rate <= MAX_RATE:
                raise ConfigError(f"--rate must be more than 0 and at most {MAX_RATE:g} requests/s, got {rate:g}")
        if self.sweep_p99_ms is not None:
            bound("--sweep-p99 (ms)", self.sweep_p99_ms, 1, 600_000)
            if not self.clients:
                raise ConfigError("--sweep-p99 needs a closed-loop run (--clients) to find the peak it searches under")
        bound("--sweep-steps", self.sweep_steps, 1, MAX_STEPS)
        bound("--duration (s)", self.duration_s, 1, MAX_DURATION_S)
        bound("--requests", self.max_requests, 1, MAX_REQUESTS)
        bound("--warmup", self.warmup, 0, 1000)
        bound("--timeout (s)", self.timeout_s, 1, 600)
        bound("--max-in-flight", self.max_in_flight, 1, MAX_IN_FLIGHT)
        bound("--start-timeout (s)", self.start_timeout_s, 1, 3600)
        if self.api_key is not None and not (self.api_key.isascii() and self.api_key.isprintable() and self.api_key):
            raise ConfigError("--api-key (MOPT_BENCH_API_KEY) is empty or holds a control or non-ASCII character "
                              "(a CR or LF read from a file?)")
        if self.runs_per_target > MAX_RUNS:
            raise ConfigError(f"{self.runs_per_target} runs per target: at most {MAX_RUNS}")
        if self.api not in API_CHOICES or self.gpus not in GPUS or self.encoding not in ENCODINGS:
            raise ConfigError(f"--api is one of {API_CHOICES}, --gpus one of {GPUS}, --encoding one of {ENCODINGS}")
        if self.encoding == "base64" and self.api == "tei":
            raise ConfigError("--encoding base64 is OpenAI's API; TEI's /embed answers JSON numbers only")

    @property
    def runs_per_target(self) -> int:
        return len(self.clients) + len(self.rates) + (self.sweep_steps if self.sweep_p99_ms is not None else 0)

    def to_json(self) -> dict:
        return asdict(self) | {"api_key": bool(self.api_key)}


@dataclass
class TargetResult:
    target: Target
    api: str = ""
    dimension: int = 0
    image: dict = field(default_factory=dict)
    start_seconds: float | None = None
    host_load: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    runs: list = field(default_factory=list)  # Run
    sweep: Sweep | None = None
    error: str = ""

    def to_json(self) -> dict:
        return {"name": self.target.name, "target": self.target.ref, "kind": self.target.kind, "api": self.api,
                "dimension": self.dimension, "image": self.image, "start_seconds": self.start_seconds,
                "host_load": self.host_load, "warnings": self.warnings, "runs": [r.to_json() for r in self.runs],
                "sweep": self.sweep.to_json() if self.sweep else None, "error": self.error}

    def points(self) -> list[Run]:
        """Every run of this target, the sweep's included: the chart's points."""
        return [*self.runs, *(s.run for s in self.sweep.steps)] if self.sweep else list(self.runs)


@dataclass
class BenchResult:
    workload: dict
    settings: Settings
    targets: list = field(default_factory=list)
    started: float = field(default_factory=time.time)
    finished: float = 0.0

    def to_json(self) -> dict:
        return {"mopt_bench": 1, "mopt_version": __version__,
                "started": _iso(self.started), "finished": _iso(self.finished),
                "host": {"platform": platform.platform(), "python": platform.python_version(),
                         "cpus": os.cpu_count()},
                "workload": self.workload, "settings": self.settings.to_json(),
                "targets": [t.to_json() for t in self.targets]}


def _iso(stamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp)) if stamp else ""


def bench(targets: list[Target], workload: Workload, settings: Settings, *, expect_sha256: str | None = None,
          progress: Progress | None = None) -> BenchResult:
    progress = progress or Progress()
    if len(targets) > MAX_TARGETS:
        raise ConfigError(f"{len(targets)} targets: at most {MAX_TARGETS} in one run")
    requests = workload.requests()
    if expect_sha256 is not None and digest(requests) != expect_sha256:
        raise ConfigError("--workload: this mopt draws other texts from that spec (sha256 differs); the run "
                          "would not repeat it")
    result = BenchResult(workload.to_json(requests), settings)
    for target in targets:
        row = TargetResult(target)
        result.targets.append(row)
        try:
            _bench_target(row, requests, workload.seed, settings, progress)
        except (MoptError, BadAnswer) as exc:
            row.error = _safe(str(exc), settings.api_key)
        except Exception as exc:  # noqa: BLE001 - one target's surprise must not lose the others' figures
            row.error = _safe(f"unexpected {type(exc).__name__}: {exc}", settings.api_key)
        if row.error:
            progress.log(f"{target.name}: FAILED: {row.error}")
    result.finished = time.time()
    return result


def _safe(text: str, api_key: str | None) -> str:
    """An error as stored and shown: one printable line, and never the API key (a server may echo it)."""
    text = printable(text, 600)
    return text.replace(api_key, "***") if api_key else text


def _bench_target(row: TargetResult, requests: list[list[str]], seed: int, settings: Settings,
                  progress: Progress) -> None:
    target, log = row.target, progress.log
    before = hostload.sample()
    row.host_load["before"] = before.to_json()
    row.warnings += [w for w in [hostload.warning("before", before)] if w]
    try:
        if target.kind == "image":
            image = Image.inspect(target.ref, log=log)
            row.image = {"id": image.image_id, "variant": image.labels.get("io.mopt.variant", ""),
                         "backend": image.labels.get("io.mopt.backend", ""), "gpu": image.gpu}
            log(f"{target.name}: starting {target.ref} (hardened, port {image.port}"
                f"{', GPUs' if settings.gpus == 'all' or (settings.gpus == 'auto' and image.gpu) else ''})")
            with Started(target, image, settings.gpus, settings.start_timeout_s) as started:
                row.start_seconds = round(started.start_seconds, 2)
                log(f"{target.name}: ready after {row.start_seconds}s at {started.base_url}")
                _measure(row, started.base_url, requests, seed, settings, progress)
        else:
            _measure(row, target.ref, requests, seed, settings, progress)
    finally:
        after = hostload.sample()
        row.host_load["after"] = after.to_json()
        row.warnings += [w for w in [hostload.warning("after", after)] if w]
        for warning in row.warnings:
            log(f"{target.name}: warning: {warning}")


def _measure(row: TargetResult, base_url: str, requests: list[list[str]], seed: int, settings: Settings,
             progress: Progress) -> None:
    name = row.target.name
    api = asyncio.run(_find_api(name, base_url, requests, settings))
    row.api = api.name
    load = Load(base_url, api, [api.body(texts, settings.model, settings.encoding) for texts in requests],
                [len(texts) for texts in requests], api_key=settings.api_key, timeout_s=settings.timeout_s,
                max_in_flight=settings.max_in_flight)
    row.dimension = asyncio.run(_strict(name, load))[0]
    log = progress.log
    log(f"{name}: {api.name} API ({api.path}), dimension {row.dimension}; warm-up {settings.warmup} requests")
    if settings.warmup:
        warm = asyncio.run(load.closed(min(4, settings.warmup), settings.duration_s, settings.warmup))
        if warm.errors:
            raise BenchError(f"the warm-up's requests failed: {_errors(warm.errors)}")

    def run(title: str, coro) -> Run:
        measured = progress.run(f"{name}: {title}", lambda tick: asyncio.run(coro(tick)))
        log(f"{name}: {title}: {_line(measured)}")
        if measured.client_cpu > CLIENT_CPU_WARN and not any(w.startswith("the load generator") for w in row.warnings):
            row.warnings.append(f"the load generator used {measured.client_cpu:.0%} of a core in the {title} run: it "
                                f"may be what limits this target (--encoding base64 makes answers 5x smaller)")
        return measured

    for clients in settings.clients:
        row.runs.append(run(f"{clients} clients", lambda tick, c=clients: load.closed(
            c, settings.duration_s, settings.max_requests, tick)))
    for index, rate in enumerate(settings.rates):  # arrivals drawn from the workload's seed, another per run
        row.runs.append(run(f"{rate:g} req/s", lambda tick, r=rate, i=index: load.open(
            r, settings.duration_s, settings.max_requests, arrival_seed(seed, i), tick)))
    if settings.sweep_p99_ms is not None:
        peak = max((r for r in row.runs if r.mode == "closed"), key=lambda r: r.requests_per_s)
        if not peak.ok:
            raise BenchError("no closed-loop request was answered, so there is no peak to sweep under")

        def measure(rate: float) -> Run:
            return run(f"sweep {rate:.3g} req/s", lambda tick: load.open(
                rate, settings.duration_s, settings.max_requests, arrival_seed(seed, round(rate * 1000)), tick))

        row.sweep = sweep(measure, peak.requests_per_s, settings.sweep_p99_ms, settings.sweep_steps)
        log(f"{name}: the highest rate with p99 <= {settings.sweep_p99_ms:g} ms: {row.sweep.answer:.3g} req/s")


def arrival_seed(workload_seed: int, run: int) -> int:
    """The seed of one open-loop run's arrivals: from the workload's --seed, another for each run."""
    return workload_seed * 1_000_003 + run


async def _find_api(name: str, base_url: str, requests: list[list[str]], settings: Settings) -> Api:
    """The API named, or (auto) OpenAI's where the server answers it; TEI's where OpenAI's route is missing
    (404/405) and TEI's answers. A 404 for another reason (vLLM's unknown --model) stays OpenAI's, so the
    strict request reports it."""
    if settings.api != "auto":
        return BY_NAME[settings.api]
    try:
        await _probe(base_url, OPENAI, requests, settings)
        return OPENAI
    except BadAnswer as exc:
        if not str(exc).startswith(("HTTP 404", "HTTP 405")):
            return OPENAI  # the strict request says what is wrong
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {base_url}: {_reason(exc)}") from None
    try:
        await _probe(base_url, TEI, requests, settings)
        return TEI
    except (BadAnswer, aiohttp.ClientError, OSError, TimeoutError):
        return OPENAI


async def _probe(base_url: str, api: Api, requests: list[list[str]], settings: Settings) -> tuple[int, int | None]:
    return await Load(base_url, api, [api.body(requests[0][:1], settings.model, settings.encoding)], [1],
                      api_key=settings.api_key, timeout_s=settings.timeout_s, max_in_flight=1).probe()


async def _strict(name: str, load: Load) -> tuple[int, int | None]:
    try:
        return await load.probe()
    except BadAnswer as exc:
        raise BenchError(f"POST {load.url} did not answer as an embeddings server: {exc}") from None
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {load.url}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    return printable(str(exc) or type(exc).__name__)


def _errors(errors: dict) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(errors.items()))


def _line(run: Run) -> str:
    p99 = run.percentile(99)
    tps = run.tokens_per_s
    return (f"{run.requests_per_s:.2f} req/s" + (f", {tps:.0f} tokens/s" if tps is not None else "")
            + (f", p99 {p99:.0f} ms" if p99 is not None else "") + (f", errors: {_errors(run.errors)}"
                                                                      if run.errors else ""))


# What `mopt release --bench` runs per variant after its smoke test: short, so a release grid shows
# speed next to status; `mopt bench` measures properly.
RELEASE_WORKLOAD = Workload(Lengths.parse("lognormal:32"), batch=8, max_words=128, distinct=64)
RELEASE_SETTINGS = Settings(clients=(4,), duration_s=5.0, warmup=4)


def release_bench(target: Target, progress: Progress | None = None) -> dict:
    """A closed-loop run of 4 clients for 5 s on the target (the tested image): the release report's figures,
    or {"error": why} when it could not be measured or any request failed."""
    result = bench([target], RELEASE_WORKLOAD, RELEASE_SETTINGS, progress=progress)
    row = result.targets[0]
    if row.error:
        return {"error": row.error}
    run = row.runs[0].to_json()
    if run["errors"] or not run["ok"]:
        failed = sum(run["errors"].values())
        return {"error": f"{failed} of {run['sent']} requests failed ({_errors(run['errors'])}); "
                         f"{run['ok']} answered"}
    return {"workload": f"{RELEASE_WORKLOAD.lengths} words x {RELEASE_WORKLOAD.batch} texts, 4 clients, 5 s",
            "requests_per_s": run["requests_per_s"], "tokens_per_s": run["tokens_per_s"],
            "p50_ms": run["latency_ms"]["p50"], "p99_ms": run["latency_ms"]["p99"], "errors": run["errors"],
            "warnings": row.warnings}
