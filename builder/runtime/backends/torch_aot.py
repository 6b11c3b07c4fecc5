"""torch.export + AOTInductor, CPU and CUDA: the package's shared library, unpacked (engine/aoti/).

AOTInductor writes a .pt2 package: a zip holding a C++ shared library (generated wrapper + kernels,
the weights appended to it) and, on CUDA, the kernel binaries. torch's package loader unpacks that
zip into a temp dir at every start and dlopens the .so from there, which fails on a noexec /tmp
(Docker's --tmpfs, a hardened Kubernetes pod) and writes an executable at start. So the compile step
unpacks the package into the engine dir once (engine/aoti/, every file hashed in engine.json like the
rest of the engine) and drops the .pt2; the loader hands the .so to torch's model container runner
(torch._C._aoti), which maps it in place and writes nothing. Same library, same outputs (bit-identical
to the package loader's on all-MiniLM-L6-v2). Loading needs torch alone, not torch._inductor, whose
import chain (Dynamo, sympy, the compiler) costs seconds of every start.

The compile step loads the finished package in a fresh process before it ships: a .so that crashes
when loaded (e.g. built by a C++ compiler that linked its own libstdc++ into it, which then meets the
process's libstdc++) fails the build with the cause named, instead of shipping an image that dies at
start.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from contextlib import nullcontext
from pathlib import Path

import torch

from .. import varlen_attention
from ..errors import UsageError
from ..fused_qk import fuse_qk_norm_rope
from ..fused_qk import wanted as fused_wanted
from ..merged import merge_projections
from ..merged import wanted as merged_wanted
from ..packed import attention_plan, pack
from ..params import EngineParams
from ..quantize import CALIBRATION_TEXTS, SMOOTHING, fp8_scales, input_ranges, kept_linears, quantize_linears
from ..sdpa import sdpa_kernels, sdpa_summary
from ..tokenization import TextEncoder
from . import dense_packing
from .torch_common import (
    DTYPES,
    build_module,
    eager_reference,
    export_graph,
    inductor_options,
    load_in_fresh_process,
    tuned_example,
)

PACKAGE = "model.pt2"  # written by the compile step, unpacked, then removed (engines of older builds keep it)
UNPACKED = "aoti"  # engine/aoti/: the package's model files (the .so, its metadata, CUDA kernel binaries)
# Inside the zip (its root is the package file's stem): the model files under data/aotinductor/<model
# name>/, the rest archive bookkeeping. The same layout in torch 2.11 (CUDA: .cubin files beside the .so)
# and 2.13.
_PACKAGE_MODEL_DIR = "data/aotinductor/model/"
# The dtype the body is built in per precision: fp8 layers sit in a bf16 body (quantize.py).
BODY_DTYPES = {**DTYPES, "fp8": torch.bfloat16}
PROBE_VOCAB = 100  # the CUDA graphs' probe calls take token ids below this: valid in every model's vocabulary
_PACKAGE_BOOKKEEPING = ("archive_format", "archive_version", "byteorder", ".data/")


def version() -> str:
    return torch.__version__


def precision_options(params: EngineParams) -> dict:
    """Inductor config a precision needs. Static fp8 scales: Inductor fuses the input's scaling and fp8 cast
    into the kernel before it and, by default, skips the bf16 rounding between them that eager does;
    all-MiniLM-L6-v2 then fell to min cosine 0.9877 on an H100 against 0.9911 eager, and rounding as eager
    does (emulate_precision_casts) gave 0.9917 (benchmarks/results/fp8_static_probe_h100_variants.json)."""
    if params.precision == "fp8" and fp8_scales() == "static":
        return {"emulate_precision_casts": True}
    return {}


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    module = build_module(model_dir, params, BODY_DTYPES.get(params.precision, torch.float32), params.device)
    body_record = prepare_body(module, params, lambda: calibrate(module, model_dir, params))
    example = tuned_example(params, params.device, pad_left=params.pad_left)
    # On CUDA, SDPA's kernel choice is baked in here (no cuDNN by default: see sdpa.py).
    kernels = sdpa_kernels() if params.device == "cuda" else nullcontext()
    options = inductor_options(params.compile_mode)
    for name, value in precision_options(params).items():
        options.setdefault(name, value)  # MOPT_INDUCTOR_OPTIONS may still say otherwise
    if params.packed and params.device == "cuda":
        # Tune Triton kernels on the example inputs run through the graph (AOTInductor's two-pass
        # compile), not on random tensors: a packed graph indexes with tensors it computes (each
        # token's sequence), and random ones trip the kernels' bounds asserts (H200, torch 2.11).
        options.setdefault("triton.autotune_at_compile_time", False)
    with torch.inference_mode(False), torch.no_grad(), kernels:
        exported, dims = export_graph(module, example, params)
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / PACKAGE),
                                                        inductor_configs=dict(options))  # it adds keys
    so = unpack(Path(path), out_dir / UNPACKED)
    Path(path).unlink()  # the unpacked files are the engine: shipping both would double the image's weights
    check_loads_fresh(out_dir, params)
    tuned = (f"{len(example[1])} sequences, {example[0].numel()} tokens" if params.packed
             else "x".join(map(str, example[0].shape)))
    recorded = {"tuned_for": tuned, "input_form": params.input_form, "inductor_options": options, **body_record}
    if params.packed:
        recorded["packed_attention"] = attention_plan(params.device, params.precision, dense_packing(params))
    if params.device == "cuda":
        recorded["sdpa"] = sdpa_summary(exported.graph)
    return {"artifact": so.relative_to(out_dir).as_posix(), "export_dims": dims,
            "embedding_dim": int(module.body.config.hidden_size), "fingerprint": recorded}  # in engine.json


def prepare_body(module, params: EngineParams, calibration) -> dict:
    """Fuse, merge and quantize MODULE's body in place as PARAMS ask; returns what engine.json records of it.
    Packed CUDA engines: Qwen3's q/k norm and rotation as one Triton kernel (fused_qk.py), then (unless
    MOPT_MERGED_PROJ=0) its parallel projections merged (merged.py) before quantizing, so each merged layer
    quantizes its input once.
    int8 (CPU): an fp32 body whose linear layers compute in int8, smoothed by CALIBRATION() (input ranges);
    fp8 (CUDA): a bf16 body whose linear layers compute in fp8, not smoothed, their inputs scaled per token
    or, with MOPT_FP8_SCALES=static, by CALIBRATION()'s ranges (quantize.py)."""
    recorded = {}
    if params.packed and params.device == "cuda":
        varlen_attention.kernel_name()  # a bad MOPT_VARLEN_KERNEL: a usage error now, not deep in the export
        fused = fuse_qk_norm_rope(module.body) if fused_wanted() else 0
        if fused:
            recorded["fused"] = {"qk_norm_rope": fused}
        merged = merge_projections(module.body) if merged_wanted() else {}
        if any(merged.values()):
            recorded["merged"] = merged
    if params.precision == "int8":
        recorded["int8"] = {"linear_layers": quantize_linears(module.body, calibration()),
                            "smoothing_alpha": SMOOTHING, "calibration_texts": len(CALIBRATION_TEXTS)}
    elif params.precision == "fp8":
        static = fp8_scales() == "static"
        recorded["fp8"] = {"linear_layers": quantize_linears(module.body, calibration() if static else None,
                                                             kind="fp8"),
                           "kept_linear": kept_linears(module.body), "format": "e4m3fn",
                           "scales": ("per-channel weights, per-tensor static activations" if static
                                      else "per-channel weights, per-token activations")}
        if static:
            recorded["fp8"]["calibration_texts"] = len(CALIBRATION_TEXTS)
    return recorded


def calibrate(module, model_dir: str, params: EngineParams) -> dict:
    """Each linear layer's input range over the calibration texts, one text per call in the engine's form."""
    encoder = TextEncoder(model_dir, params.pooling, params.instruction)
    ids = [seq[:params.max_seq_len] for seq in encoder.encode(list(CALIBRATION_TEXTS))]

    def run():
        for seq in ids:
            if params.packed:
                yield module(*(t.to(params.device) for t in pack([seq], dense_packing(params))))
            else:
                t = torch.tensor([seq], device=params.device)
                yield module(t, torch.ones_like(t))
    return input_ranges(module.body, run)


def unpack(package: Path, dest: Path) -> Path:
    """Unpack the package's model files into DEST (what torch's loader does at every start) and return
    the .so. Refuses a package with anything else in it (weights kept outside the .so, several models):
    the runner in load() would not find it."""
    root = package.stem + "/"
    model_dir, bookkeeping = root + _PACKAGE_MODEL_DIR, tuple(root + b for b in _PACKAGE_BOOKKEEPING)
    with zipfile.ZipFile(package) as zf:
        model, unexpected = [], []
        for name in (n for n in zf.namelist() if not n.endswith("/")):
            if name.startswith(bookkeeping):
                continue
            rel = name[len(model_dir):] if name.startswith(model_dir) else ""
            (model if rel and "/" not in rel else unexpected).append(name)
        if unexpected:
            raise RuntimeError(f"{package.name} holds files the unpacked loader does not use: {unexpected[:5]}")
        dest.mkdir(parents=True, exist_ok=True)
        for name in model:
            (dest / name[len(model_dir):]).write_bytes(zf.read(name))
    libraries = sorted(dest.glob("*.so"))
    if len(libraries) != 1:
        raise RuntimeError(f"{package.name} should hold one shared library, found {[p.name for p in libraries]}")
    return libraries[0]


def check_loads_fresh(engine_dir: Path, params: EngineParams) -> None:
    """Load the engine and call it in a fresh process: a crash there must fail the build, not the
    first container start."""
    proc = load_in_fresh_process(__name__, engine_dir, params)
    if proc.returncode == 0 and "LOADED" in proc.stdout:
        return
    how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
    # The last line is the Python error; AOTInductor's runner says what failed in the lines before it.
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    cause = [line for line in lines[-12:-1] if "error" in line.lower()][-2:]
    detail = [" | ".join([*cause, lines[-1]])] if proc.returncode > 0 and lines else []
    libraries = sorted((engine_dir / UNPACKED).glob("*.so"))
    raise RuntimeError(f"the compiled library {libraries[0].name if libraries else '(none)'} does not load: a "
                       f"fresh process loading it {how}{': ' + detail[0] if detail else ''}"
                       f"{cxx_runtime_hint(libraries[0]) if libraries else ''}")


def cxx_runtime_hint(so: Path) -> str:
    """Why a .so may crash at load: a C++ runtime of its own, linked in by the compiler."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return ""
    needed = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True).stdout
    if "libstdc++.so" in needed:
        return ""
    compiler = os.environ.get("CXX") or "g++"
    return (f"; its .so does not link libstdc++.so dynamically: the C++ compiler ({compiler}) linked a "
            "libstdc++ of its own into it, which clashes with the one this Python process loaded; set CXX to "
            "the system's g++ (the one whose libstdc++ this process uses) and compile again")


def _package_runner(path: str, models: int = 1):
    """torch's C++ package loader, called directly: torch._inductor's public wrapper would import
    Dynamo and the compiler first (seconds of a start). The wrapper where this torch lacks the class."""
    loader_cls = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_cls is None:
        from torch._inductor import aoti_load_package

        runner = aoti_load_package(path)
        return lambda *inputs: runner(*inputs)
    loader = loader_cls(path, "model", False, models, -1)  # path, model name, single-threaded, runners, device index
    return lambda *inputs: loader.run(list(inputs))[0]


def _library_runner(unpacked: Path, device: str, models: int = 1):
    """torch's model container runner on the unpacked .so: dlopen in place, nothing written. The CUDA
    runner finds the kernel binaries (cubin_dir) next to the .so, where the package loader put them."""
    (so,) = sorted(unpacked.glob("*.so"))  # the compile step checked there is exactly one
    if device == "cuda":
        runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(so), models, "cuda", str(unpacked))
    else:
        runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(so), 1)
    return lambda *inputs: runner.run(list(inputs))[0]


def load(engine_dir: str | Path, params: EngineParams):
    engine_dir = Path(engine_dir)

    def open_runner(models: int = 1):
        """A model container of MODELS instances: the weights once, each instance its own run state."""
        if (engine_dir / UNPACKED).is_dir():
            return _library_runner(engine_dir / UNPACKED, params.device, models)
        # an engine compiled before the unpacking: the package loader unpacks into TMPDIR at start
        return _package_runner(str(engine_dir / PACKAGE), models)

    runner = open_runner()
    device = params.device

    def direct(*inputs: torch.Tensor) -> torch.Tensor:  # (ids, mask), or packed (ids, seq_lengths, max_len)
        return runner(*(t.to(device).contiguous() for t in inputs))

    call = direct
    if params.packed and device == "cuda":  # small calls replayed from CUDA graphs (cudagraphs.py says why)
        from ..cudagraphs import graphed

        with torch.no_grad():
            call = graphed(direct, params, PROBE_VOCAB, open_runner)

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return call(*inputs).float().cpu()

    run.cuda_graphs = call is not direct  # for benchmarks and tests: whether the graphs are in use
    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    return eager_reference(model_dir, texts, params)


def prepare(device: str) -> None:
    """Nothing to warm: the package loader needs torch alone."""


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
    raise UsageError("torch-aot engines are served by mopt's own server, not exec_serve")
