"""Inductor-compiled engine made at image-build time, for CUDA (and CPU): no tracing, no codegen,
no autotuning when the image starts.

The aot flavours use torch-aot (the AOTInductor .pt2). This is the alternative form: no C++ wrapper
to build, the same kernels, a slower start (it imports Inductor and loads Triton kernels from
Python); docs/backends.md says when each was used and docs/performance.md has the figures.

The compiled form (compile step, in the exact runtime image, on the target GPU):
1. torch.export of the embedding module with dynamic batch and sequence dims (the graph torch-aot
   exports too), so one graph serves every batch 1..max_batch and length 2..max_seq_len;
2. torch._inductor.standalone_compile of that graph in the recipe's compile mode (default, or
   max-autotune-no-cudagraphs: Triton GEMM templates autotuned here, once), saved as one file with
   the generated code, the compiled Triton kernels and the autotune choices (inductor-artifact.bin);
3. graph.json: the graph's inputs in order (parameters and buffers by name, then the user inputs).
The graph's parameters, buffers and constants ship as safetensors shards named by graph input, and
so does the Inductor cache a fresh load of the artifact writes (inductor-cache/: its kernels built,
so a start builds none). At start the loader reads the tensors straight to the device, loads the
artifact over a writable mirror of that cache (links to the shipped files, in MOPT_COMPILE_CACHE_DIR
or a temp dir: cachemirror.py) and calls it with the flat inputs: no nn.Module is built,
transformers is not imported, Dynamo never runs. The artifact is bound to the exact torch build (torch checks its own
source hash); if it does not load, the loader falls back to torch.compile at first call (slow but
correct) and says so.

If the artifact cannot be made (an older torch, an export failure), the compile step ships the
previous form instead: the Inductor/Triton caches written while torch.compile warmed the shapes
(inductor-cache/), which remove codegen and autotuning but not Dynamo's tracing at start.

engine/ layout: artifact form: weights/config.json, graph.json, graph-tensors-*.safetensors (256 MB
shards, so the guard hashes them in parallel), inductor-artifact.bin, inductor-cache/** (the load's);
cache form: weights/ (config + safetensors), inductor-cache/** (the warm-up's); both:
compile_cache.json (the manifest). The guard hashes
every file; engine_sha256 is that of compile_cache.json, which lists them too.
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
import torch._inductor

from ..cachemirror import temp_dir_until_exit, writable_mirror
from ..errors import UsageError
from ..params import EngineParams
from ..pooling import EmbeddingModule, attention_implementation
from ..sdpa import sdpa_backends, sdpa_kernels, sdpa_summary
from .torch_common import (
    DTYPES,
    build_module,
    call_example,
    eager_reference,
    example_inputs,
    export_graph,
    inductor_options,
    load_in_fresh_process,
    tuned_example,
    wrap_body,
)

ARTIFACT = "compile_cache.json"
CACHE_SUBDIR = "inductor-cache"
WEIGHTS_SUBDIR = "weights"
SHARD_BYTES = 256 << 20  # weights and graph tensors are saved in shards the guard hashes in parallel
ENV_RUNTIME_CACHE = "MOPT_COMPILE_CACHE_DIR"  # where the loader puts its writable copy
ENV_WARM_AT_LOAD = "MOPT_COMPILE_CACHE_WARM"  # 1: replay the warm-up shapes inside load()
ENV_ARTIFACT = "MOPT_INDUCTOR_ARTIFACT"  # 0: neither write nor load the artifact (the cache form)
INDUCTOR_ARTIFACT = "inductor-artifact.bin"
GRAPH_FILE = "graph.json"
GRAPH_TENSORS = "graph-tensors-{:05d}.safetensors"  # parameters, buffers and constants, by graph name
LAST_LOAD_PATH = None  # "artifact", "cache" or "jit": which path the last load() took (benchmarks read it)
log = logging.getLogger(__name__)


def version() -> str:
    return torch.__version__


def warmup_shapes(params: EngineParams) -> list[tuple[int, int]]:
    """The shapes the compile step runs. Both dims are marked dynamic and batch 1 is padded to 2
    (see _call), so one graph serves every batch 1..max_batch and length 2..max_seq_len."""
    return [(2, min(16, params.max_seq_len))]


def _call(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """Run on any shape. Padded (ids, mask): size-1 dims get specialised by tracing, so a single row
    is run as two identical rows and the first result kept. Packed (ids, seq_lengths, max_len): the
    graph's dims start at 1 (torch_common's export), so inputs go as they are."""
    if len(inputs) != 2:
        return fn(*(t.contiguous() for t in inputs))
    input_ids, attention_mask = inputs
    n = input_ids.shape[0]
    if n == 1:
        input_ids, attention_mask = input_ids.expand(2, -1), attention_mask.expand(2, -1)
    return fn(input_ids.contiguous(), attention_mask.contiguous())[:n]


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


def _call_dynamic(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """torch.compile path: mark every dim dynamic so one trace serves every shape (but a dim of 1,
    which tracing specialises: a packed call's one row; a call of one sequence traces once more)."""
    for t in inputs:
        for dim in range(t.dim()):
            if t.shape[dim] > 1:
                torch._dynamo.mark_dynamic(t, dim)
    return fn(*inputs)


def _inductor_options(mode: str) -> dict:
    return {"config_patches": inductor_options(mode)}


def _graph_inputs(exported) -> list[dict]:
    """The lifted graph's placeholders in order: parameters/buffers by FQN, constants by name, user inputs."""
    return [{"kind": spec.kind.name, "target": spec.target, "name": spec.arg.name}
            for spec in exported.graph_signature.input_specs]


def _flat_inputs(specs: list[dict], tensors: dict[str, torch.Tensor]):
    """A builder of the artifact's argument list: graph tensors fixed once, the user inputs (ids and
    mask, or the packed ids, seq_lengths and max_len) per call, in the graph's order."""
    fixed: list = []
    for spec in specs:
        kind = spec["kind"]
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            fixed.append(tensors[spec["target"]])
        elif kind == "USER_INPUT":
            fixed.append(spec["name"])  # filled per call
        else:
            raise RuntimeError(f"graph input kind {kind} ({spec['name']}) is not supported by the artifact loader")
    slots = [i for i, name in enumerate(fixed) if isinstance(name, str)]
    names = [fixed[i] for i in slots]
    if names not in (["input_ids", "attention_mask"], ["input_ids", "seq_lengths", "max_len"]):
        raise RuntimeError(f"unexpected user inputs {names} in the exported graph")

    def build(*inputs: torch.Tensor) -> list:
        args = list(fixed)
        for i, tensor in zip(slots, inputs, strict=True):
            args[i] = tensor
        return args
    return build


def _graph_tensors(exported, module: EmbeddingModule, specs: list[dict]) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters())
    named.update(module.named_buffers())
    out = {}
    for spec in specs:
        if spec["kind"] in ("PARAMETER", "BUFFER"):
            out[spec["target"]] = named[spec["target"]]
        elif spec["kind"] == "CONSTANT_TENSOR":
            out[spec["target"]] = exported.constants[spec["target"]]
    return out


def save_graph_tensors(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Shards of at most ~shard_bytes. Every tensor is saved as its own copy: safetensors refuses
    tensors that share storage, so a tied weight is stored once per name."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous().clone()
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    names = []
    for i, shard in enumerate(shards, start=1):
        names.append(GRAPH_TENSORS.format(i))
        save_file(shard, str(out_dir / names[-1]))
    return names


def load_graph_tensors(engine_dir: Path, files: list[str], device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(engine_dir / name), device=device))
    return tensors


def _artifact_runner(artifact, build):
    def run(*inputs: torch.Tensor) -> torch.Tensor:
        return artifact(*build(*inputs))[0]
    return run


def make_artifact(module: EmbeddingModule, params: EngineParams, out_dir: Path) -> dict:
    """Export -> standalone_compile -> inductor-artifact.bin + graph.json + graph tensors; checks they load."""
    from torch._inductor.standalone_compile import CompiledArtifact

    if params.max_batch < 2:
        raise RuntimeError("max_batch 1: the artifact's graph needs a dynamic batch dim (the loader pads 1 row to 2)")
    # The example's sizes are the hints Inductor tunes for (torch_common.tune_shape). Both dims stay
    # dynamic (1..max_batch, 2..max_seq_len) in the graph.
    example = tuned_example(params, params.device, params.pad_left)
    t0 = time.monotonic()
    with torch.no_grad(), sdpa_kernels():
        exported, dims = export_graph(module, example, params)
    t_export = time.monotonic() - t0
    specs = _graph_inputs(exported)
    tensors = _graph_tensors(exported, module, specs)
    gm = exported.graph_module
    # The graph's own fake inputs carry the symbolic batch/sequence sizes; real tensors would specialise.
    fakes = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
    t1 = time.monotonic()
    with torch.no_grad(), sdpa_kernels():
        compiled = torch._inductor.standalone_compile(gm, fakes, dynamic_shapes="from_graph",
                                                      options=_inductor_options(params.compile_mode))
    t_compile = time.monotonic() - t1
    compiled.save(path=str(out_dir / INDUCTOR_ARTIFACT), format="binary")
    files = save_graph_tensors(tensors, out_dir)
    (out_dir / GRAPH_FILE).write_text(json.dumps({"inputs": specs, "export_dims": dims, "tensor_files": files},
                                                 indent=1) + "\n")
    # The saved files, not the in-memory function, must load and agree with eager on a padded batch.
    loaded = CompiledArtifact.load(path=str(out_dir / INDUCTOR_ARTIFACT), format="binary")
    run = _artifact_runner(loaded, _flat_inputs(specs, load_graph_tensors(out_dir, files, params.device)))
    with torch.no_grad():
        got, want = run(*example).float(), module(*example).float()
    cos = torch.nn.functional.cosine_similarity(got, want).min().item()
    if not cos >= 0.99:
        raise RuntimeError(f"the loaded artifact disagrees with eager (cosine {cos:.4f})")
    return {"file": INDUCTOR_ARTIFACT, "bytes": (out_dir / INDUCTOR_ARTIFACT).stat().st_size,
            "export_dims": dims, "export_seconds": round(t_export, 3), "compile_seconds": round(t_compile, 3),
            "check_cosine": round(cos, 6), "mode": params.compile_mode,
            "tuned_for": (f"{len(example[1])} sequences, {example[0].numel()} tokens" if params.packed
                          else "x".join(map(str, example[0].shape))), **sdpa_summary(exported.graph)}


def _warm(fn, params: EngineParams) -> list[dict]:
    done = []
    with torch.no_grad():
        for b, s in warmup_shapes(params):
            t = time.monotonic()
            _call(fn, *(call_example(params, params.device) if params.packed
                        else example_inputs(b, s, params.device, params.pad_left)))
            if params.device == "cuda":
                torch.cuda.synchronize()
            done.append({"batch": b, "seq": s, "seconds": round(time.monotonic() - t, 3)})
    return done


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    sdpa_backends()  # a bad MOPT_SDPA_BACKENDS is the user's error (exit 2), not a reason to fall back
    dtype = DTYPES[params.precision]
    module = build_module(model_dir, params, dtype, params.device)
    cache = out_dir / CACHE_SUBDIR
    scratch = Path(tempfile.mkdtemp(prefix="mopt-inductor-compile-"))
    try:
        return _compile(module, params, out_dir, cache, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compile(module, params: EngineParams, out_dir: Path, cache: Path, scratch: Path) -> dict:
    # Inductor compiles through its caches: the artifact's compile in a scratch dir (what ships is
    # the cache a fresh load writes, unpack_artifact), the cache form's warm-up in the shipped dir.
    _point_caches(scratch)
    torch._dynamo.reset()
    artifact: dict = {"skipped": f"{ENV_ARTIFACT}=0"}
    warm: list[dict] = []
    if os.environ.get(ENV_ARTIFACT, "1") != "0":
        try:
            artifact = make_artifact(module, params, out_dir)
        except Exception as exc:  # the cache form below still gives an engine
            for path in [out_dir / INDUCTOR_ARTIFACT, out_dir / GRAPH_FILE, *out_dir.glob("graph-tensors-*")]:
                path.unlink(missing_ok=True)
            artifact = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            log.warning("inductor artifact failed, shipping the cache form: %s", artifact["error"])
    if (out_dir / INDUCTOR_ARTIFACT).is_file():
        module.body.config.save_pretrained(out_dir / WEIGHTS_SUBDIR)  # the weights are the graph tensors
        unpack_artifact(out_dir, params)
        form = "artifact"
    else:
        module.body.save_pretrained(out_dir / WEIGHTS_SUBDIR, safe_serialization=True, max_shard_size=SHARD_BYTES)
        _point_caches(cache)
        torch._dynamo.reset()
        with torch._inductor.config.patch(_inductor_options(params.compile_mode)["config_patches"]):
            warm = _warm(lambda *inputs: _call_dynamic(_compiled(module), *inputs), params)
        form = "cache"
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    manifest = {"torch": torch.__version__, "form": form, "artifact": artifact, "warmup": warm, "files": files,
                "mode": params.compile_mode,
                "shapes": ("packed: tokens, sequences and the longest dynamic (one graph)" if params.packed else
                           "batch and sequence dims dynamic (one graph; the loader pads batch 1 to 2)")}
    (out_dir / ARTIFACT).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {"artifact": ARTIFACT, "export_dims": artifact.get("export_dims", "torch.compile dynamic"),
            "embedding_dim": int(module.body.config.hidden_size)}


# Imported by the artifact's load (a cProfile of the load found them): done in prepare(), they overlap hashing.
PRELOAD_MODULES = ("torch._inductor.standalone_compile", "torch._inductor.codecache",
                   "torch._inductor.output_code", "torch._inductor.async_compile", "torch._inductor.kernel",
                   "torch._inductor.runtime.triton_heuristics", "torch._functorch._aot_autograd.aot_autograd_result",
                   "triton.runtime.cache")


def prepare(device: str) -> None:
    """Start-up work that needs no engine file (the guard overlaps it with hashing): the artifact
    loader's imports, and on CUDA no compile worker pool: the artifact's Triton kernels are compiled
    already and starting the pool costs seconds. On the CPU the artifact's
    C++ kernels are built at load, where the pool helps."""
    import importlib

    import torch._inductor.config as inductor_config

    for name in PRELOAD_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another torch version: the load imports what it needs itself
            pass
    if device == "cuda":
        inductor_config.compile_threads = 1


def runtime_cache_dir(engine_dir: Path) -> Path:
    """Inductor's cache dir for a load: a writable mirror of the shipped cache (links to its files,
    cachemirror.py), so kernels load from the engine dir and nothing executable is written at start."""
    base = os.environ.get(ENV_RUNTIME_CACHE) or temp_dir_until_exit("mopt-inductor-")  # a caller's dir is kept
    dest = Path(base) / "cache"
    shutil.rmtree(dest, ignore_errors=True)
    if (engine_dir / CACHE_SUBDIR).is_dir():
        return writable_mirror(engine_dir / CACHE_SUBDIR, dest)
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def unpack_artifact(out_dir: Path, params: EngineParams) -> None:
    """Ship the Inductor cache that loading the artifact writes (its kernels compiled, the Python
    wrappers written) as CACHE_SUBDIR: a start then finds every kernel there, so it runs no compiler
    and writes nothing executable (a noexec /tmp is enough), and it skips the load's kernel builds.
    Made by the served load itself, in a fresh process, so the cache keys are the ones a start asks for."""
    work = Path(tempfile.mkdtemp(prefix="mopt-inductor-unpack-"))
    try:
        proc = load_in_fresh_process(__name__, out_dir, params, env={ENV_RUNTIME_CACHE: str(work)}, timeout=1800)
        if proc.returncode != 0 or "LOADED artifact" not in proc.stdout:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"loading the artifact in a fresh process failed ({tail}); no engine shipped")
        shutil.copytree(work / "cache", out_dir / CACHE_SUBDIR, ignore=shutil.ignore_patterns("locks", "*.lock"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _module(engine_dir: Path, params: EngineParams, tensors: dict[str, torch.Tensor] | None = None):
    """The nn.Module, for the torch.compile paths: from weights/, or from the config + graph tensors."""
    if tensors is None:
        return build_module(str(engine_dir / WEIGHTS_SUBDIR), params, DTYPES[params.precision],
                                      params.device).eval()
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(str(engine_dir / WEIGHTS_SUBDIR))
    with torch.device(params.device):
        body = AutoModel.from_config(config, dtype=DTYPES[params.precision],
                                     attn_implementation=attention_implementation(
                                         "packed" if params.packed else params.attention))
    state = {k.removeprefix("body."): v for k, v in tensors.items() if k.startswith("body.")}
    body.load_state_dict(state, strict=False)  # non-persistent buffers are rebuilt by the constructor
    return wrap_body(body, params).eval()


def load(engine_dir: str | Path, params: EngineParams):
    from torch._inductor.standalone_compile import CompiledArtifact

    engine_dir = Path(engine_dir)
    prepare(params.device)
    _point_caches(runtime_cache_dir(engine_dir))
    global LAST_LOAD_PATH
    fn, tensors = None, None
    if (engine_dir / INDUCTOR_ARTIFACT).is_file():
        graph = json.loads((engine_dir / GRAPH_FILE).read_text())
        tensors = load_graph_tensors(engine_dir, graph["tensor_files"], params.device)
        if os.environ.get(ENV_ARTIFACT, "1") != "0":
            try:
                artifact = CompiledArtifact.load(path=str(engine_dir / INDUCTOR_ARTIFACT), format="binary")
                fn, LAST_LOAD_PATH = _artifact_runner(artifact, _flat_inputs(graph["inputs"], tensors)), "artifact"
            except Exception as exc:  # another torch build (torch checks its source hash) or a corrupt file
                log.warning("the Inductor artifact did not load (%s: %s); compiling with torch.compile at first "
                            "call (minutes on a GPU)", type(exc).__name__, exc)
    if fn is None:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = inductor_config.decide_compile_threads()  # compiling after all
        compiled = _compiled(_module(engine_dir, params, tensors))
        fn = lambda *inputs: _call_dynamic(compiled, *inputs)  # noqa: E731
        # the cache form's warm-up cache; an artifact that did not load compiles anew ("jit")
        cache_form = (engine_dir / CACHE_SUBDIR).is_dir() and not (engine_dir / INDUCTOR_ARTIFACT).is_file()
        LAST_LOAD_PATH = "cache" if cache_form else "jit"
    if os.environ.get(ENV_WARM_AT_LOAD, "0") == "1":
        _warm(fn, params)  # else the first request pays the one-time costs
    device = params.device

    def run(*inputs: torch.Tensor) -> torch.Tensor:  # (ids, mask), or packed (ids, seq_lengths, max_len)
        with torch.no_grad():
            out = _call(fn, *(t.to(device) for t in inputs))
        return out.float().cpu()

    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    return eager_reference(model_dir, texts, params)


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
    raise UsageError("torch-inductor engines are served by mopt's own server, not exec_serve")
