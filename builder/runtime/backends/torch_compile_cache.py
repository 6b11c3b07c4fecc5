"""torch.compile engine whose Inductor/Triton caches are built at image-build time (CPU and CUDA).

Why: CUDA AOTInductor packages (.pt2) segfault on load with torch 2.11.0+cu130 on the H200
machine (inside AOTIModelPackageLoader, even for a 3-layer MLP without constants), so the CUDA
engine is shipped as the artifacts torch.compile itself reuses: the model weights in the engine
precision, plus the FX-graph / Triton kernel / autotune caches written while the compile step
warmed every shape class the loader can send. At start the loader copies the caches to a
writable dir, points TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR at it and replays the warm-up:
Dynamo traces again, but Inductor codegen, Triton compiles and autotuning are cache hits.

Precompiled graph (torch >= 2.11, `torch.compile(fn, fullgraph=True).aot_compile(...)`): the compile
step also saves Dynamo's traced bytecode + the Inductor graph as precompiled.bin (guards kept:
tensor metadata, dynamic-shape ranges, global state; torch.compiler.keep_portable_guards_unsafe).
The loader deserialises it with torch.compiler.load_compiled_function, so a fresh process does not
trace; if saving or loading it fails, the loader falls back to torch.compile over the caches.

engine/ layout: weights/ (config.json + model.safetensors), inductor-cache/**, precompiled.bin
(when the precompile worked), compile_cache.json.
The guard hashes every file; engine_sha256 is that of compile_cache.json, which lists them too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ..params import EngineParams
from ..pooling import EmbeddingModule, load_body
from . import torch_aot

ARTIFACT = "compile_cache.json"
CACHE_SUBDIR = "inductor-cache"
WEIGHTS_SUBDIR = "weights"
VERSION_IS_TORCH = True
DTYPES = torch_aot.DTYPES
ENV_RUNTIME_CACHE = "MOPT_COMPILE_CACHE_DIR"  # where the loader puts its writable copy
ENV_WARM_AT_LOAD = "MOPT_COMPILE_CACHE_WARM"  # 1: replay the warm-up shapes inside load()
ENV_PRECOMPILE = "MOPT_PRECOMPILE"  # 0: neither write nor load precompiled.bin
PRECOMPILED = "precompiled.bin"
LAST_LOAD_PATH = None  # "precompiled" or "cache": which path the last load() took (benchmarks read it)
reference = torch_aot.reference
log = logging.getLogger(__name__)


def version() -> str:
    return torch.__version__


def warmup_shapes(params: EngineParams) -> list[tuple[int, int]]:
    """The shapes the compile step runs. Both dims are marked dynamic and batch 1 is padded to 2
    (see _call), so one graph serves every batch 1..max_batch and length 2..max_seq_len."""
    return [(2, min(16, params.max_seq_len))]


def _call(fn, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Run the compiled module on any shape without a recompile: Dynamo specialises size-1 dims,
    so a single row is run as two identical rows and the first result kept."""
    n = input_ids.shape[0]
    if n == 1:
        input_ids, attention_mask = input_ids.expand(2, -1), attention_mask.expand(2, -1)
    input_ids, attention_mask = input_ids.contiguous(), attention_mask.contiguous()
    for t in (input_ids, attention_mask):
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 1)
    return fn(input_ids, attention_mask)[:n]


def _point_caches(cache_dir: Path) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    import torch._inductor.config as ic

    ic.fx_graph_cache = True
    ic.autotune_local_cache = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)


def _compiled(module: EmbeddingModule):
    return torch.compile(module, fullgraph=False)


def _forward(module, input_ids, attention_mask):
    """Module passed as an argument, so the saved graph holds no reference to this process's module."""
    return module(input_ids, attention_mask)


def _guard_filter():
    keep = getattr(torch.compiler, "keep_portable_guards_unsafe", None)
    if keep is not None:
        return keep
    return lambda entries: [e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV")
                            or (e.guard_type == "TENSOR_MATCH" and not e.is_global) for e in entries]


def precompile(module: EmbeddingModule, params: EngineParams, path: Path) -> dict:
    """Save Dynamo + Inductor output for every shape (both dims dynamic) to path; needs Inductor caches on."""
    b, s = warmup_shapes(params)[0]
    ids, mask = torch_aot.example_inputs(b, s, params.device, params.pooling == "last")
    for t in (ids, mask):
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(t, 1)
    t0 = time.monotonic()
    with torch.no_grad():
        fn = torch.compile(_forward, fullgraph=True, options={"guard_filter_fn": _guard_filter()})
        compiled = fn.aot_compile(((module, ids, mask), {}))
        compiled.save_compiled_function(str(path))
    return {"file": path.name, "seconds": round(time.monotonic() - t0, 3), "bytes": path.stat().st_size}


def load_precompiled(path: Path, module: EmbeddingModule):
    with open(path, "rb") as f:
        compiled = torch.compiler.load_compiled_function(f)
    fallback = []

    def run(input_ids, attention_mask):
        if not fallback:
            try:
                return compiled(module, input_ids, attention_mask)
            except RuntimeError as exc:  # a shape outside the saved guards (e.g. length 1): trace once
                if "GuardManager check failed" not in str(exc):
                    raise
                log.warning("precompiled graph refused %s; compiling with torch.compile", tuple(input_ids.shape))
                fallback.append(_compiled(module))
        return fallback[0](input_ids, attention_mask)
    return run


def _warm(fn, params: EngineParams) -> list[dict]:
    done = []
    with torch.no_grad():
        for b, s in warmup_shapes(params):
            t = time.monotonic()
            _call(fn, *torch_aot.example_inputs(b, s, params.device, params.pooling == "last"))
            if params.device == "cuda":
                torch.cuda.synchronize()
            done.append({"batch": b, "seq": s, "seconds": round(time.monotonic() - t, 3)})
    return done


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    dtype = DTYPES[params.precision]
    module = torch_aot.build_module(model_dir, params, dtype, params.device)
    module.body.save_pretrained(out_dir / WEIGHTS_SUBDIR, safe_serialization=True)
    cache = out_dir / CACHE_SUBDIR
    _point_caches(cache)
    torch._dynamo.reset()
    pre: dict = {"skipped": "MOPT_PRECOMPILE=0"}
    if os.environ.get(ENV_PRECOMPILE, "1") != "0":
        try:
            pre = precompile(module, params, out_dir / PRECOMPILED)
            _warm(load_precompiled(out_dir / PRECOMPILED, module), params)  # the saved file must load and run
        except Exception as exc:  # the cache path below still gives an engine
            (out_dir / PRECOMPILED).unlink(missing_ok=True)
            pre = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            log.warning("precompile failed, shipping the cache path only: %s", pre["error"])
        torch._dynamo.reset()
    warm = _warm(_compiled(module), params)
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    manifest = {"torch": torch.__version__, "warmup": warm, "files": files, "precompile": pre,
                "mode": "torch.compile default mode, batch and sequence dims dynamic (mark_dynamic)"}
    (out_dir / ARTIFACT).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {"artifact": ARTIFACT, "export_dims": "torch.compile dynamic",
            "embedding_dim": int(module.body.config.hidden_size)}


def runtime_cache_dir(engine_dir: Path) -> Path:
    base = os.environ.get(ENV_RUNTIME_CACHE) or tempfile.mkdtemp(prefix="mopt-inductor-")
    dest = Path(base) / "cache"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(engine_dir / CACHE_SUBDIR, dest)  # inductor writes into its cache dir
    return dest


def load(engine_dir: str | Path, params: EngineParams):
    engine_dir = Path(engine_dir)
    _point_caches(runtime_cache_dir(engine_dir))
    body = load_body(str(engine_dir / WEIGHTS_SUBDIR), DTYPES[params.precision], params.device)
    if hasattr(body.config, "use_cache"):
        body.config.use_cache = False
    module = EmbeddingModule(body, params.pooling, params.normalize, left_padded=params.pooling == "last")
    global LAST_LOAD_PATH
    fn, LAST_LOAD_PATH = None, "cache"
    if (engine_dir / PRECOMPILED).is_file() and os.environ.get(ENV_PRECOMPILE, "1") != "0":
        try:
            fn = load_precompiled(engine_dir / PRECOMPILED, module)
            LAST_LOAD_PATH = "precompiled"
        except Exception as exc:  # another torch build, a guard or pickle error: trace again instead
            log.warning("precompiled graph did not load (%s: %s); using the cache path", type(exc).__name__, exc)
    if fn is None:
        fn = _compiled(module)
    if os.environ.get(ENV_WARM_AT_LOAD, "0") == "1":
        _warm(fn, params)  # else the first request traces (cache hit: no codegen, no autotune)
    device = params.device

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = _call(fn, input_ids.to(device), attention_mask.to(device))
        return out.float().cpu()

    return run
