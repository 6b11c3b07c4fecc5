"""The compile step: engine + tokenizer files + engine.json + fp32 reference, all in one OUT dir.

OUT/engine/        compiled artifact, tokenizer files, config.json (all that serving needs)
OUT/engine.json    fingerprint (fingerprint.py)
OUT/reference.json texts + fp32 eager embeddings from transformers, same process and host
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from . import fingerprint
from .backends import get_backend
from .engine import engine_encoder
from .errors import CompileError, RuntimeToolError, UsageError
from .families import model_family
from .gate import gate_texts, model_windows, per_class
from .hostinfo import host_facts
from .params import EngineParams
from .tokenization import copy_tokenizer_files

REFERENCE_JSON = "reference.json"
# The lowest cosine vs the fp32 reference an engine may have and still be written (the recipe's
# smoke.min_cosine reaches it as --min-cosine; the smoke test checks the served engine again).
DEFAULT_MIN_COSINE = 0.99
COMPILE_STATS = ".compile-stats.json"
DEFAULT_TEXTS = (
    "What is the capital of France?",
    "Paris is the capital and largest city of France.",
    "A GPU inference image must match the host's compute capability.",
    "hello world",
)


def _check_inputs(model_dir: Path, params: EngineParams, target_sm: str | None, facts) -> None:
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"--model {model_dir}: no config.json there (expected a Hugging Face model dir)")
    if not (model_dir / "tokenizer.json").is_file():
        raise UsageError(f"--model {model_dir}: no tokenizer.json there (a fast tokenizer is required)")
    model_family(model_dir, packed=params.packed)  # an unknown architecture: refused before any weights load
    if params.device == "cpu" and target_sm:
        raise UsageError("--target-sm applies to --device cuda only")
    if params.device == "cuda":
        if facts.sm is None:
            raise UsageError("--device cuda but torch sees no CUDA GPU on this host")
        if target_sm and str(target_sm) != facts.sm:
            # Engines are compiled on the arch they target; never cross-compile silently.
            raise UsageError(f"--target-sm {target_sm} but this host's GPU is sm_{facts.sm} "
                             f"({facts.gpu_name}); compile on an sm_{target_sm} GPU")


def compile_engine(model_dir: str | Path, out_dir: str | Path, params: EngineParams, *,
                   target_sm: str | None = None, image: dict | None = None,
                   reference_texts: list[str] | None = None, verify: bool = True,
                   min_cosine: float = DEFAULT_MIN_COSINE, extra: dict | None = None) -> dict:
    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir)
    facts = host_facts()
    _check_inputs(model_dir, params, target_sm, facts)
    backend = get_backend(params.backend)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine_dir = out_dir / fingerprint.ENGINE_SUBDIR
    staging = out_dir / ".engine.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for stale in (fingerprint.ENGINE_JSON, REFERENCE_JSON, COMPILE_STATS):  # nothing of an earlier compile
        (out_dir / stale).unlink(missing_ok=True)                             # survives a failed one

    started = time.monotonic()
    try:
        info = backend.compile(str(model_dir), params, staging)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-built stays behind
        if isinstance(exc, RuntimeToolError):  # the backend's own verdict (e.g. bad input: exit 2) keeps its code
            raise
        raise CompileError(f"{params.backend} compile of {model_dir} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
    compile_seconds = round(time.monotonic() - started, 2)
    min_dim = params.matryoshka_min_dim
    if min_dim is not None and min_dim > info["embedding_dim"]:
        shutil.rmtree(staging, ignore_errors=True)
        raise UsageError(f"--matryoshka-min-dim {min_dim} is more than the model's {info['embedding_dim']} dimensions")
    copy_tokenizer_files(model_dir, staging)
    shutil.copyfile(model_dir / "config.json", staging / "config.json")
    shutil.rmtree(engine_dir, ignore_errors=True)
    staging.rename(engine_dir)

    files = fingerprint.file_hashes(engine_dir)
    data = {
        "backend": params.backend, "backend_version": backend.version(),
        "torch": facts.torch, "cuda": facts.cuda, "tensorrt": facts.tensorrt,
        "device": params.device,
        "target_sm": facts.sm if params.device == "cuda" else None,
        "gpu_name": facts.gpu_name if params.device == "cuda" else None,
        "driver": facts.driver if params.device == "cuda" else None,
        "engine_files": files, "engine_sha256": files[info["artifact"]], "artifact": info["artifact"],
        "embedding_dim": info["embedding_dim"], "export_dims": info.get("export_dims"),
        "model_digest": fingerprint.model_digest(model_dir),
        "params": params.to_dict(), "image": image,
        **(info.get("fingerprint") or {}),  # backend-specific facts (e.g. vLLM's cache digest)
        **(extra or {}),
    }
    texts = list(reference_texts) if reference_texts else list(DEFAULT_TEXTS)
    # The gate's texts: every length class to max_seq_len and past each window, several scripts (gate.py).
    encoder = engine_encoder(out_dir, params)
    texts += [t for t in gate_texts(encoder, params.max_seq_len, model_windows(model_dir)) if t not in texts]
    tokens = [min(len(ids), params.max_seq_len) for ids in encoder.encode(texts)]
    ref = {"texts": texts, "tokens": tokens, "source": "transformers eager fp32, one text per call (unpadded)",
           "pooling": params.pooling, "normalize": params.normalize,
           "embeddings": backend.reference(str(model_dir), texts, params)}
    if verify:
        ref["min_cosine"] = min_cosine  # the threshold an opt-in recompile on another host must meet too
        cosines = _verify(out_dir, data, params, texts, ref["embeddings"])
        got = min(cosines)
        ref["engine_min_cosine"] = round(got, 6)  # recorded rounded; the gate compares the exact figure
        ref["classes"] = data["accuracy_by_length"] = per_class(tokens, cosines)
        # The gate's verdict as a whole, for the engine's precision: what the report and the docs quote.
        data["accuracy"] = {"precision": params.precision, "texts": len(cosines), "min": round(got, 6),
                            "mean": round(sum(cosines) / len(cosines), 6), "min_cosine": min_cosine}
        if not got >= min_cosine:  # NaN too
            shutil.rmtree(engine_dir, ignore_errors=True)  # no engine.json yet: nothing half-built stays
            # The rounded figure, unless rounding would hide the miss (0.9899996 against 0.99).
            shown = ref["engine_min_cosine"] if ref["engine_min_cosine"] < min_cosine else got
            worst = min(ref["classes"].items(), key=lambda kv: kv[1]["min"])
            raise CompileError(f"the {params.backend} engine of {model_dir} reaches cosine {shown} vs the fp32 "
                               f"reference (worst: {worst[0]}-token texts, min {worst[1]['min']}), below "
                               f"--min-cosine {min_cosine}: refused, no engine written")
    (out_dir / REFERENCE_JSON).write_text(json.dumps(ref) + "\n")
    # Timings vary run to run: kept beside the engine (a dotfile the image does not ship), not in
    # engine.json, so two compiles of the same inputs give the same engine dir.
    (out_dir / COMPILE_STATS).write_text(json.dumps({"compile_seconds": compile_seconds}) + "\n")
    fingerprint.write(out_dir, data)  # last: its presence means the engine dir is complete
    return {"engine_dir": str(out_dir), "backend": params.backend, "device": params.device,
            "target_sm": data["target_sm"], "engine_sha256": data["engine_sha256"],
            "compile_seconds": compile_seconds, "embedding_dim": data["embedding_dim"],
            "engine_min_cosine": ref.get("engine_min_cosine")}


def _verify(out_dir: Path, data: dict, params: EngineParams, texts, expected) -> list[float]:
    """Each text's cosine against its reference, the texts in one engine call (as the server mixes them)."""
    from .engine import Engine

    got = Engine.from_info(out_dir, data, params).embed_texts(texts)
    return [cosine(a, b) for a, b in zip(got, expected, strict=True)]


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    na = sum(x * x for x in a) ** 0.5
    nb = sum(y * y for y in b) ** 0.5
    return dot / (na * nb) if na and nb else 0.0
