"""The engine cache of a mounted model (`serve --model-id DIR --cache-dir CACHE`, `warm`).

A runtime image carries no model: the first start compiles the user's model in that container (the
exact runtime, the actual GPU) into CACHE, and later starts load what it holds. An entry is keyed by
everything the engine depends on: the model's content digest, the engine parameters, this runtime's
identity (its own code and every installed distribution), the GPU and the versions the guard compares.

CACHE/engines/<key>/       an engine dir as `compile` writes it (engine/, engine.json, reference.json)
CACHE/engines/<key>.lock   flock'd while one process checks or compiles that entry; another waits
CACHE/digests/<stat>.json  a model's content digest, keyed by its files' names, sizes, mtimes and
                           ctimes, so a warm start does not hash gigabytes of weights again

An entry is served only after the start-up guard (every engine file's sha256 against engine.json, the
host against the build) and only if its engine.json records this very key and model digest; anything
else is moved aside and compiled again. The compile runs as a child process (`compile`, the same
accuracy gate as release builds: exit 4 below --min-cosine), into a temporary dir renamed into place
once complete, so a killed compile leaves no entry. The lock is flock(2): two containers on one volume
of one host share it; it is not reliable on network file systems (docs/run-image.md).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from . import SCHEMA_VERSION, fingerprint, guard
from .errors import CompileError, GuardError, UsageError
from .params import EngineParams

log = logging.getLogger("mopt_runtime.cache")

CACHE_FORMAT = 2  # bump when the key's inputs or the layout change: old entries are then not read
RUNTIME_ID_ENV = "MOPT_RUNTIME_ID"  # set by a runtime image's build (its stage key): part of the key
# Fields of the parameters that do not change the engine: where the model is mounted and its name.
UNKEYED_PARAMS = ("model_dir", "model_name")
# Compile-time variables (docs/environment.yaml, `where: compile`) that change what the compile step makes:
# an entry compiled under one setting is not served under another. MOPT_TRT_TIMING_CACHE is not keyed: it
# names where TensorRT keeps its timing cache, not what the engine is.
KEYED_SWITCHES = ("MOPT_FP8_SCALES", "MOPT_FUSED_QK", "MOPT_INDUCTOR_ARTIFACT", "MOPT_INDUCTOR_OPTIONS",
                  "MOPT_MERGED_PROJ", "MOPT_SDPA_BACKENDS", "MOPT_TUNE_SHAPE", "MOPT_VARLEN_KERNEL",
                  "MOPT_VARLEN_TILES")
UNKEYED_SWITCHES = ("MOPT_TRT_TIMING_CACHE",)
AHEAD_ENTRIES = 2  # entries hashed while torch imports (bounded: each may be gigabytes)
AHEAD_SWITCH_S = 0.0005  # the GIL's switch interval meanwhile (Python's default is 5 ms)


@dataclass(frozen=True)
class ModelSource:
    """What `serve --model-id` resolves into an engine dir: picklable (the engine worker resolves it)."""

    model_dir: str
    cache_dir: str
    params: EngineParams  # conventions applied, model_dir set
    min_cosine: float
    reference_texts: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CacheResult:
    engine_dir: Path
    data: dict  # its engine.json, checked
    key: str
    outcome: str  # "hit", "compiled" (no entry) or "rebuilt" (an entry refused)
    seconds: float
    reason: str = ""  # why an entry was refused


def _event(name: str, **fields) -> None:
    """A JSON line on stdout, as the server's own events ("loading", "serving")."""
    print(json.dumps({"event": name, **fields}), flush=True)


def _tree_digest(root: Path, suffixes: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def runtime_identity() -> str:
    """This runtime, as content: Python, the runtime's own files, every installed distribution's name
    and version, and the image's stage key when its build set one. A rebuilt image with other
    packages or code computes another identity, so its engines are compiled again."""
    from importlib import metadata

    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"]})
    src = {"python": sys.version, "implementation": sys.implementation.name,
           "runtime": _tree_digest(Path(__file__).parent, (".py", ".yaml", ".json")),
           "distributions": dists, "image": os.environ.get(RUNTIME_ID_ENV, "")}
    return hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()


def _stat_listing(model_dir: Path) -> str:
    rows = []
    for rel in fingerprint.tree_files(model_dir):  # the files fingerprint.model_digest reads
        if rel.startswith(".cache/"):  # as fingerprint.model_digest
            continue
        st = (model_dir / rel).stat()
        rows.append(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}")
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def model_digest(model_dir: Path, cache_dir: Path | None) -> str:
    """fingerprint.model_digest, remembered per stat listing: a file edited in place gets a new ctime
    (which no user call can set back), so a changed model is hashed again; an unchanged one is not."""
    if cache_dir is None:
        return fingerprint.model_digest(model_dir)
    memo = cache_dir / "digests" / f"{_stat_listing(model_dir)}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        digest = json.loads(memo.read_text())["model_digest"]
        if isinstance(digest, str) and len(digest) == 64:
            return digest
    digest = fingerprint.model_digest(model_dir)
    with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model_digest": digest}) + "\n")
        os.replace(tmp, memo)
    return digest


def cpu_capability() -> str:
    """The CPU instruction set torch's CPU kernels (and Inductor's generated code) are built for, e.g.
    AVX512: a cpu engine from an AVX-512 host must not load on an AVX2 one (SIGILL)."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older torch: the machine name at least
        import platform

        return platform.machine()


def _keyed_params(params: dict) -> dict:
    return {k: v for k, v in params.items() if k not in UNKEYED_PARAMS}


def compile_switches(environ=os.environ) -> dict[str, str]:
    """The keyed compile-time variables that are set (the compile child inherits this environment)."""
    return {name: environ[name] for name in KEYED_SWITCHES if name in environ}


def cache_key(digest: str, params: EngineParams, runtime_id: str, facts, min_cosine: float, cpu: str,
              switches: dict[str, str] | None = None) -> str:
    keyed = _keyed_params(params.to_dict())
    host = {"torch": facts.torch, "cuda": facts.cuda, "tensorrt": facts.tensorrt}
    if params.device == "cpu":
        host["cpu"] = cpu
    if params.device == "cuda":  # the GPU and the driver an engine was compiled and timed on
        host |= {"sm": facts.sm, "gpu_name": facts.gpu_name, "driver": facts.driver}
    src = {"format": CACHE_FORMAT, "schema": SCHEMA_VERSION, "model": digest, "params": keyed,
           "runtime": runtime_id, "host": host, "min_cosine": min_cosine, "switches": switches or {}}
    return hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()[:32]


@contextlib.contextmanager
def _locked(lock_path: Path, key: str, exclusive: bool):
    """flock on LOCK_PATH, shared (checking an entry: many starts at once) or exclusive (replacing or
    compiling it); yields False where the cache cannot be written (a read-only, pre-warmed volume)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.info("engine cache not writable (%s): using it read-only", exc.strerror)
        yield False
        return
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("engine %s: another process holds it (compiling or replacing it); waiting", key)
            _event("engine-cache-wait", key=key)
            fcntl.flock(fd, mode)
        yield True
    finally:
        os.close(fd)  # releases the lock


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sweep(engines: Path, held: str) -> None:
    """Remove what killed compiles and removals left (.tmp-KEY-*, .refused-KEY-*): for HELD, whose lock this
    process holds, all of it; for another key, only when its lock is free (no compile of it is running)."""
    stale: dict[str, list[Path]] = {}
    for path in (*engines.glob(".tmp-*"), *engines.glob(".refused-*")):
        stale.setdefault(path.name.split("-")[1], []).append(path)
    for key, paths in stale.items():
        if key == held:
            for path in paths:
                _remove(path)
        else:
            _remove_unless_locked(engines / f"{key}.lock", paths)


def _remove_unless_locked(lock_path: Path, paths: list[Path]) -> None:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for path in paths:  # under its lock: no compile of that key starts meanwhile
            _remove(path)
    except BlockingIOError:
        pass  # its compile is running
    finally:
        os.close(fd)


def _likely_entries(engines: Path, digest: str, params: EngineParams) -> list[Path]:
    """The entries compiled from this model with these parameters (usually one; another GPU or runtime
    sharing the cache adds one each), newest first, at most AHEAD_ENTRIES."""
    wanted = _keyed_params(params.to_dict())
    found = []
    with contextlib.suppress(OSError):
        for path in engines.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                meta = path / fingerprint.ENGINE_JSON
                data = json.loads(meta.read_bytes())
                if (data["model_digest"] == digest and data["cache"]["key"] == path.name
                        and _keyed_params(data["params"]) == wanted):
                    found.append((meta.stat().st_mtime_ns, path))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
    return [path for _, path in sorted(found, reverse=True)[:AHEAD_ENTRIES]]


def _entry_problem(entry: Path, key: str, digest: str, facts, ahead=None) -> tuple[str | None, dict]:
    """(None, engine.json) if ENTRY may be served; otherwise (why not, {}). AHEAD: guard.integrity_ahead's
    result for ENTRY, if it was hashed while torch imported."""
    if not (entry / fingerprint.ENGINE_JSON).is_file():
        return "no engine.json (an incomplete entry)", {}
    try:
        data = guard.check(entry, facts, ahead)
    except GuardError as err:
        return err.message, {}
    listed = set(data["engine_files"])
    extra = sorted(p.relative_to(entry / fingerprint.ENGINE_SUBDIR).as_posix()
                   for p in (entry / fingerprint.ENGINE_SUBDIR).rglob("*")
                   if (p.is_file() or p.is_symlink()) and p.relative_to(entry / fingerprint.ENGINE_SUBDIR).as_posix()
                   not in listed)
    if extra:
        return f"files engine.json does not list: {', '.join(extra[:3])}", {}
    recorded = data.get("cache") or {}
    if recorded.get("key") != key:
        return f"its engine.json records key {recorded.get('key')!r}, not {key}", {}
    if data.get("model_digest") != digest:
        return "its engine.json records another model digest", {}
    return None, data


def _die_with_parent():
    """For the compile child, before exec: SIGKILL when the process that started it dies (a server stopped
    during its first start must not leave a compile running; prctl PR_SET_PDEATHSIG, Linux). prctl is
    looked up here, in the parent: after fork in a threaded process only the call itself is safe."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGKILL))


def _compile_child(source: ModelSource, tmp: Path, key: str, digest: str) -> None:
    """`compile` in a child process: its memory (the fp32 reference model, the compiler) is returned to
    the system when it exits, and the serving process never holds it."""
    params_file = tmp.parent / f"{tmp.name}.params.json"
    params_file.write_text(json.dumps(source.params.to_dict()) + "\n")
    argv = [sys.executable, "-m", __package__, "compile", "--model", source.model_dir, "--out", str(tmp),
            "--params", str(params_file), "--min-cosine", repr(source.min_cosine), "--cache-key", key,
            "--force-pooling"]  # conventions were applied already: the params say what was decided
    if source.reference_texts:
        texts = tmp.parent / f"{tmp.name}.texts.json"
        texts.write_text(json.dumps(list(source.reference_texts)))
        argv += ["--reference-texts", str(texts)]
    # The child's JSON result goes to stderr with its log: stdout carries this process's events.
    proc = subprocess.Popen(argv, stdout=sys.stderr, stderr=sys.stderr, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=_die_with_parent())  # noqa: PLW1509 - prctl only, no locks taken
    try:
        code = proc.wait()
    except BaseException:
        proc.kill()  # the server is stopping: no orphaned compile keeps the lock's work going
        proc.wait()
        raise
    finally:
        for extra in tmp.parent.glob(f"{tmp.name}.*.json"):
            extra.unlink(missing_ok=True)
    if code != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        err = CompileError(f"compiling {source.model_dir} failed (exit {code}; the log above says why)")
        err.exit_code = code if code == UsageError.exit_code else CompileError.exit_code  # bad model: 2
        raise err
    data = fingerprint.read(tmp)
    if (data.get("cache") or {}).get("key") != key or data.get("model_digest") != digest:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CompileError(f"the compile of {source.model_dir} recorded another key or model digest "
                           "(the model changed while it compiled?): start again")


def resolve_cached(source: ModelSource, facts=None) -> CacheResult:
    """The engine dir for SOURCE: a cache entry that passes the guard, or one compiled now. A file-system
    error (an unreadable model, a cache that cannot be written) is one UsageError naming the path."""
    try:
        return _resolve(source, facts)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise UsageError(f"the model {source.model_dir} or the engine cache {source.cache_dir}: "
                         f"{exc.strerror or exc}{where}") from None


def _resolve(source: ModelSource, facts) -> CacheResult:
    from .hostinfo import host_facts

    started = time.monotonic()
    parts = {}  # where a start's time goes (the events carry it; benchmarks/model_cache_start.py reads it)

    def lap(name: str, t: float) -> float:
        now = time.monotonic()
        parts[name] = round(now - t, 3)
        return now

    model_dir, cache_dir = Path(source.model_dir), Path(source.cache_dir)
    engines = cache_dir / "engines"
    with contextlib.suppress(OSError):
        engines.mkdir(parents=True, exist_ok=True)
    digest = model_digest(model_dir, cache_dir)
    t = lap("model_digest", started)
    # The key needs the host's facts, and they need torch (seconds to import): meanwhile the entries this
    # start will probably check are hashed in threads (hashlib releases the GIL), so the guard need not.
    # The import holds the GIL between the hashes' chunks: a short switch interval hands it over sooner.
    pool = ThreadPoolExecutor(max_workers=AHEAD_ENTRIES)
    likely = _likely_entries(engines, digest, source.params)
    ahead = {path.name: pool.submit(guard.integrity_ahead, path) for path in likely}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(AHEAD_SWITCH_S)
    try:
        runtime_id = runtime_identity()
        t = lap("runtime_identity", t)
        facts = facts or host_facts()
        t = lap("host_facts", t)
        key = cache_key(digest, source.params, runtime_id, facts, source.min_cosine, cpu_capability(),
                        compile_switches())
        entry = engines / key
        # Checked under a shared lock: replicas starting together load at once; only a miss waits its turn.
        with _locked(engines / f"{key}.lock", key, exclusive=False) as writable:
            hashed = ahead[key].result() if key in ahead else None
            t = lap("hashing_ahead", t)
            problem, data = _entry_problem(entry, key, digest, facts, hashed)
    finally:
        sys.setswitchinterval(switch)
        pool.shutdown(wait=False, cancel_futures=True)  # another host's entry need not finish hashing
    lap("guard", t)
    parts |= {f"guard_{name}": value for name, value in guard.LAST_CHECK_SECONDS.items()}

    def hit(data: dict) -> CacheResult:
        result = CacheResult(entry, data, key, "hit", round(time.monotonic() - started, 2))
        _event("engine-cache", outcome="hit", key=key, seconds=result.seconds, parts=parts)
        return result

    if problem is None:
        return hit(data)
    if not writable:
        raise GuardError(f"the engine cache {cache_dir} is read-only and holds no engine for this model, "
                         f"parameters, runtime and GPU (key {key}: {problem}); mount it writable or warm it "
                         "with `mopt warm`")
    with _locked(engines / f"{key}.lock", key, exclusive=True):
        problem, data = _entry_problem(entry, key, digest, facts)  # another process may have compiled it
        if problem is None:
            return hit(data)
        exists = entry.exists()
        if exists:
            log.warning("engine cache entry %s refused (%s): compiling it again", key, problem)
            entry.rename(engines / f".refused-{key}-{uuid.uuid4().hex}")
        _sweep(engines, key)
        tmp = engines / f".tmp-{key}-{uuid.uuid4().hex}"
        log.warning("compiling the engine of %s (key %s, %s %s on %s): the first start for this model, "
                    "parameters, runtime and GPU; later starts load it from %s", model_dir, key,
                    source.params.backend, source.params.precision,
                    f"sm_{facts.sm}" if source.params.device == "cuda" else "cpu", entry)
        _event("engine-cache-compiling", key=key, model=str(model_dir))
        _compile_child(source, tmp, key, digest)
        tmp.rename(entry)
        problem_after, data = _entry_problem(entry, key, digest, facts)
        if problem_after is not None:  # the engine just compiled fails its own guard: never served
            raise GuardError(f"the engine compiled into {entry} fails the start-up guard: {problem_after}")
        outcome = "rebuilt" if exists else "compiled"
        result = CacheResult(entry, data, key, outcome, round(time.monotonic() - started, 2), problem if exists else "")
        _event("engine-cache", outcome=outcome, key=key, seconds=result.seconds, reason=result.reason)
        log.warning("engine %s %s in %.1fs", key, outcome, result.seconds)
        _sweep(engines, key)  # the refused entry, now that the new one is in place
        return result


def model_source(model_id: str, cache_dir: str | None, params: EngineParams, given: set[str], *,
                 min_cosine: float, force_pooling: bool = False,
                 reference_texts: list[str] | None = None) -> ModelSource:
    """Check --model-id and --cache-dir and resolve the parameters against the model's own files."""
    from .conventions import apply_conventions

    if "://" in model_id:
        raise UsageError(f"--model-id {model_id}: only a mounted model directory is supported by this runtime; "
                         "download the model on the host (or `mopt warm` there) and mount it read-only")
    model = Path(model_id)
    if not model.is_dir():
        raise UsageError(f"--model-id {model_id}: not a directory (mount the model, e.g. -v /models/m:/model:ro)")
    for needed in ("config.json", "tokenizer.json"):
        if not (model / needed).is_file():
            raise UsageError(f"--model-id {model_id}: no {needed} there (expected a Hugging Face model dir "
                             "with a fast tokenizer)")
    if not cache_dir:
        raise UsageError("--model-id needs --cache-dir (MOPT_CACHE_DIR): where the compiled engine is kept")
    cache = Path(cache_dir)
    if cache.exists() and not cache.is_dir():
        raise UsageError(f"--cache-dir {cache_dir}: not a directory")
    inside = cache.resolve().is_relative_to(model.resolve()) or model.resolve().is_relative_to(cache.resolve())
    if inside:
        raise UsageError(f"--cache-dir {cache_dir} and --model-id {model_id} overlap: the cache must be outside the "
                         "model directory (its files would change the model's digest) and hold no model")
    if not -1.0 <= min_cosine <= 1.0:
        raise UsageError(f"--min-cosine must be in -1..1, got {min_cosine}")
    params = apply_conventions(params, model, given, force=force_pooling)
    params = replace(params, model_dir=str(model.resolve()), model_name=params.model_name or model.resolve().name)
    return ModelSource(str(model.resolve()), str(cache.resolve()), params, min_cosine,
                       tuple(reference_texts) if reference_texts else None)


def locate(target: str | Path | ModelSource) -> tuple[Path, dict]:
    """The engine dir to serve and its checked engine.json: a baked engine dir through the guard
    (guard.resolve), or a mounted model's cache entry."""
    if isinstance(target, ModelSource):
        result = resolve_cached(target)
        return result.engine_dir, result.data
    return guard.resolve(target)
