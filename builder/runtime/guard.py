"""Start-up guard: refuse an engine that was altered or does not fit this host, and say which
image tag would fit. Opt-in (MOPT_RECOMPILE_ON_MISMATCH=1 + MOPT_ENGINE_CACHE) recompiles instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import fingerprint
from .backends import backend_info, get_backend
from .errors import GuardError
from .fitting import ENV_CACHE, ENV_RECOMPILE, fitting_tag, sm_label
from .hostinfo import HostFacts, host_facts
from .params import PRECISION_MIN_SM, EngineParams, backend_precisions

LAST_CHECK_SECONDS: dict[str, float] = {}  # each overlapped part of the last check() (start-up benchmarks read it)


class EngineMismatch(GuardError):
    """The engine is intact but was built for another GPU or software stack (recompilable)."""


def _integrity(out_dir: Path, data: dict) -> None:
    engine_dir = out_dir / fingerprint.ENGINE_SUBDIR
    bad, present = [], []
    for rel, want in sorted(data["engine_files"].items()):
        if (engine_dir / rel).is_file():
            present.append((rel, want))
        else:
            bad.append(f"{rel} is missing")
    # hashlib releases the GIL on large buffers: files (weights are saved in shards) hash in parallel.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(present)))) as pool:
        got = list(pool.map(lambda item: fingerprint.sha256_file(engine_dir / item[0]), present))
    bad += [f"{rel} sha256 differs from engine.json" for (rel, want), sha in zip(present, got, strict=True)
            if sha != want]
    artifact = data.get("artifact")
    if artifact and data["engine_files"].get(artifact) != data["engine_sha256"]:
        bad.append(f"engine_sha256 in engine.json does not match the recorded sha256 of {artifact}")
    if bad:
        raise GuardError(f"engine in {engine_dir} failed its integrity check: {'; '.join(bad)}; "
                         "rebuild or re-pull the image")


def engine_file_stats(out_dir: Path, files) -> tuple:
    """Each listed engine file's inode, size, mtime and ctime (None if absent): a file rewritten, replaced
    or touched differs here (no user call sets a ctime back)."""
    engine_dir = out_dir / fingerprint.ENGINE_SUBDIR
    rows = []
    for rel in sorted(files):
        try:
            st = (engine_dir / rel).stat()
            rows.append((rel, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        except OSError:
            rows.append((rel, None))
    return tuple(rows)


@dataclass(frozen=True)
class Ahead:
    """The integrity part of check() done ahead, in this process (the model cache hashes the entry it will
    probably serve while torch imports). check() uses it only for the very engine.json it read and files
    whose stats are unchanged since they were hashed; anything else is hashed again."""

    engine_json: bytes
    stats: tuple
    problem: str | None  # the integrity failure found, or None


def integrity_ahead(out_dir: str | Path) -> Ahead | None:
    """Hash OUT_DIR's engine files now (GIL released: this overlaps imports); None where there is nothing
    to hold on to (no readable engine.json, or files that changed while they were hashed)."""
    out_dir = Path(out_dir)
    try:
        raw, data = fingerprint.read_raw(out_dir)
        stats = engine_file_stats(out_dir, data["engine_files"])
        try:
            _integrity(out_dir, data)
            problem = None
        except GuardError as err:
            problem = err.message
    except (GuardError, OSError, TypeError, AttributeError):
        return None
    if engine_file_stats(out_dir, data["engine_files"]) != stats:
        return None
    return Ahead(raw, stats, problem)


def _environment(data: dict, facts: HostFacts) -> list[str]:
    diffs = []
    if data["device"] == "cuda":
        built = sm_label(data["target_sm"], data.get("gpu_name"))
        if facts.sm is None:
            why = f" ({facts.gpu_problem})" if facts.gpu_problem else ""
            diffs.append(f"engine built for {built} but this host has no usable CUDA GPU{why}")
        elif facts.sm != str(data["target_sm"]):
            diffs.append(f"engine built for {built} but this host's GPU is "
                         f"{sm_label(facts.sm, facts.gpu_name)}")
    if data["torch"] != facts.torch:
        diffs.append(f"engine built with torch {data['torch']} but this host runs torch {facts.torch}")
    if data["cuda"] != facts.cuda:
        diffs.append(f"engine built with CUDA {data['cuda']} but this host's torch has CUDA {facts.cuda}")
    if data["tensorrt"] != facts.tensorrt:
        diffs.append(f"engine built with TensorRT {data['tensorrt']} but this host has {facts.tensorrt}")
    # A torch backend's version is torch's, already compared above (against facts, so tests can fake it).
    if not backend_info(data["backend"]).version_is_torch:
        here = get_backend(data["backend"]).version()
        if data["backend_version"] != here:
            diffs.append(f"engine built with {data['backend']} {data['backend_version']} but this host has {here}")
    return diffs


def check(out_dir: str | Path, facts: HostFacts | None = None, ahead: Ahead | None = None) -> dict:
    """Return engine.json if the engine may be served here; raise GuardError otherwise. AHEAD: this
    process's integrity check of the same files, done earlier (used only if nothing changed since)."""
    out_dir = Path(out_dir)
    raw, data = fingerprint.read_raw(out_dir)
    times = LAST_CHECK_SECONDS
    times.clear()
    if ahead is not None and (ahead.engine_json != raw
                              or ahead.stats != engine_file_stats(out_dir, data["engine_files"])):
        ahead = None

    def timed(name, fn, *args):
        t = time.monotonic()
        try:
            return fn(*args)
        finally:
            times[name] = round(time.monotonic() - t, 3)

    with ThreadPoolExecutor(max_workers=2) as pool:
        # Hashing (GIL released), CUDA initialisation for the host facts and the backend's imports
        # (torch._inductor: seconds) overlap instead of adding up.
        pending = None if facts else pool.submit(timed, "host_facts", host_facts)
        integrity = None if ahead is not None else pool.submit(timed, "integrity", _integrity, out_dir, data)
        if backend_info(data["backend"]).prepares:
            timed("backend_prepare", get_backend(data["backend"]).prepare, data["device"])
        if integrity is not None:
            integrity.result()
        elif ahead.problem:
            raise GuardError(ahead.problem)
        facts = facts or pending.result()
    diffs = _environment(data, facts)
    if diffs:
        raise EngineMismatch(f"{'; '.join(diffs)}: {fitting_tag(data.get('image'), facts)}")
    return data


def resolve(out_dir: str | Path, env=None, facts: HostFacts | None = None) -> tuple[Path, dict]:
    """The engine dir to serve: the given one if it fits, else (opt-in) a cached recompile."""
    env = os.environ if env is None else env
    try:
        return Path(out_dir), check(out_dir, facts)
    except EngineMismatch as err:
        if env.get(ENV_RECOMPILE) != "1":
            raise
        cache = env.get(ENV_CACHE)
        if not cache:
            raise GuardError(f"{err.message}; {ENV_RECOMPILE}=1 also needs {ENV_CACHE}=/path") from None
        return _recompile(Path(out_dir), Path(cache), facts or host_facts(), err)


def recompile_precision(backend: str, precision: str, device: str, sm: str | None) -> str:
    """The engine's precision where its backend takes it on this device and the GPU computes in it (bf16 on
    a GPU, int8 on a CPU, fp8 from sm_89); a precision the GPU lacks (fp8 before sm_89) becomes bf16, a
    precision the backend does not take here fp32."""
    if device == "cuda" and sm and int(sm) < PRECISION_MIN_SM.get(precision, 0):
        return "bf16" if "bf16" in backend_precisions(backend, device) else "fp32"
    return precision if precision in backend_precisions(backend, device) else "fp32"


def _recompile(out_dir: Path, cache: Path, facts: HostFacts, err: GuardError) -> tuple[Path, dict]:
    from .compiler import DEFAULT_MIN_COSINE, REFERENCE_JSON, compile_engine

    data = fingerprint.read(out_dir)
    old = EngineParams.from_dict(data["params"])
    model_dir = old.model_dir
    if not model_dir or not Path(model_dir).is_dir():
        raise GuardError(f"{err.message}; cannot recompile: model dir {model_dir!r} is not present") from None
    if fingerprint.model_digest(model_dir) != data["model_digest"]:
        raise GuardError(f"{err.message}; cannot recompile: the model in {model_dir} differs from "
                         "the one this engine was built from (an image whose engine holds the weights, label "
                         "io.mopt.model.weights=in-engine, ships the model without them)") from None
    device = "cuda" if facts.sm else "cpu"
    params = EngineParams.from_dict({**old.to_dict(), "device": device,
                                     "precision": recompile_precision(old.backend, old.precision, device, facts.sm)})
    key_src = {"model": data["model_digest"], "params": params.to_dict(), "host": facts.to_dict()}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:16]
    target = cache / key
    try:
        return target, check(target, facts)  # a valid engine from an earlier start
    except GuardError:
        pass
    ref_path = out_dir / REFERENCE_JSON
    ref = json.loads(ref_path.read_text()) if ref_path.is_file() else {}
    # Verified as the original was: an engine compiled without the check (a chat model) has no figure.
    compile_engine(model_dir, target, params, image=data.get("image"), reference_texts=ref.get("texts"),
                   verify="engine_min_cosine" in ref, min_cosine=ref.get("min_cosine", DEFAULT_MIN_COSINE),
                   extra={"recompiled_from": str(out_dir.resolve()), "recompile_reason": err.message})
    return target, check(target, facts)
