"""TensorRT: ONNX export (torch.onnx, dynamic batch and sequence axes) inside the runtime image, then
a serialized engine built with the TensorRT Python API (engine/model.plan).

engine/model.plan      the serialized engine (the artifact)
engine/timing.cache    the builder's timing cache (persisted; reused from $MOPT_TRT_TIMING_CACHE too)
engine/trt-build.json  the profile, builder flags, TensorRT version and compute capability

tensorrt is imported lazily, inside functions: the guard, the build side and the unit tests import
this module on hosts without TensorRT (it cannot be installed on the build machines; see docs/backends.md).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import GuardError, UsageError
from ..params import EngineParams

ARTIFACT = "model.plan"
TIMING_CACHE = "timing.cache"
BUILD_INFO = "trt-build.json"
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embedding"
ENV_TIMING_CACHE = "MOPT_TRT_TIMING_CACHE"  # a file shared between builds (e.g. a cache mount)
# Builder flags (tensorrt.BuilderFlag member names) per precision. Reduced-precision builds keep
# FP16 as the fallback for layers without int8/fp8 kernels; fp32 sets none (TF32 stays default).
PRECISION_FLAGS = {
    "fp32": (),
    "fp16": ("FP16",),
    "bf16": ("BF16",),
    "int8": ("INT8", "FP16"),
    "fp8": ("FP8", "FP16"),
}
# recipe engine.tensorrt.hardware_compatibility -> tensorrt.HardwareCompatibilityLevel member.
HARDWARE_LEVELS = {"none": "NONE", "ampere_plus": "AMPERE_PLUS", "same_compute_capability": "SAME_COMPUTE_CAPABILITY"}
log = logging.getLogger(__name__)


def _trt():
    import tensorrt

    return tensorrt


def version() -> str:
    try:
        return _trt().__version__
    except ImportError:
        return "not-installed"


# --- pure functions (unit-tested without TensorRT) -------------------------------------------------

def profile_shapes(params: EngineParams) -> dict[str, tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """min/opt/max (batch, seq) of the one optimisation profile, for both inputs."""
    opt_batch = params.trt_opt_batch or params.max_batch
    opt_seq = params.trt_opt_seq_len or params.max_seq_len
    lo, opt, hi = (params.trt_min_batch, params.trt_min_seq_len), (opt_batch, opt_seq), (params.max_batch,
                                                                                          params.max_seq_len)
    for i, what in ((0, "batch"), (1, "seq_len")):
        if not 1 <= lo[i] <= opt[i] <= hi[i]:
            raise ValueError(f"TensorRT profile needs 1 <= min_{what} <= opt_{what} <= max_{what}, "
                             f"got {lo[i]}, {opt[i]}, {hi[i]}")
    return {name: (lo, opt, hi) for name in INPUTS}


def precision_flags(precision: str) -> tuple[str, ...]:
    try:
        return PRECISION_FLAGS[precision]
    except KeyError:
        raise ValueError(f"no TensorRT builder flags for precision {precision!r}; "
                         f"one of {', '.join(PRECISION_FLAGS)}") from None


def builder_flag_values(trt, params: EngineParams) -> list:
    """The tensorrt.BuilderFlag members to set for these params (precision + version compatibility)."""
    names = list(precision_flags(params.precision))
    if params.trt_version_compatible:
        names.append("VERSION_COMPATIBLE")
    missing = [n for n in names if not hasattr(trt.BuilderFlag, n)]
    if missing:
        raise RuntimeError(f"TensorRT {getattr(trt, '__version__', '?')} has no BuilderFlag {', '.join(missing)} "
                           f"(needed for precision {params.precision})")
    return [getattr(trt.BuilderFlag, n) for n in names]


def hardware_level(trt, params: EngineParams):
    name = HARDWARE_LEVELS[params.trt_hardware_compatibility]
    level = getattr(trt.HardwareCompatibilityLevel, name, None)
    if level is None:
        raise RuntimeError(f"TensorRT {getattr(trt, '__version__', '?')} has no hardware compatibility level "
                           f"{name} (SAME_COMPUTE_CAPABILITY needs TensorRT 10.9+)")
    return level


_LIB = re.compile(r"expecting library version (?P<runtime>[\w.]+) got (?P<plan>[\w.]+)")
_COMPUTE = re.compile(r"expecting compute (?P<plan>\d+)\.(?P<plan_minor>\d+) got compute "
                      r"(?P<host>\d+)\.(?P<host_minor>\d+)")
_SERIAL = re.compile(r"stdVersionRead == serializationVersion|Version tag does not match")


def map_error(text: str, data: dict | None = None, facts=None) -> GuardError | None:
    """TensorRT's own deserialisation error text -> the guard's actionable GuardError (exit 3), or None
    when the text is no known portability error. data: engine.json; facts: hostinfo.HostFacts."""
    from ..fitting import fitting_tag
    from ..hostinfo import HostFacts

    facts = facts or HostFacts(torch="", cuda=None, tensorrt=None, sm=None, gpu_name=None, driver=None)
    data = data or {}
    tag = fitting_tag(data.get("image"), facts)
    m = _LIB.search(text)
    if m:
        # "expecting" is the running library, "got" is what the plan was serialised with.
        built = data.get("tensorrt") or m["plan"]
        return GuardError(f"engine built with TensorRT {built} but this host's TensorRT is {m['runtime']} "
                          f"(TensorRT: engine plan file not compatible with this version): {tag}")
    m = _COMPUTE.search(text)
    if m:
        plan_sm, host_sm = f"{m['plan']}{m['plan_minor']}", f"{m['host']}{m['host_minor']}"
        if data.get("target_sm"):
            plan_sm = str(data["target_sm"])
        if facts.sm:
            host_sm = facts.sm
        if not facts.sm:  # name the tag for the GPU TensorRT saw
            tag = fitting_tag(data.get("image"), HostFacts(**{**facts.to_dict(), "sm": host_sm}))
        return GuardError(f"engine built for sm_{plan_sm} but this host's GPU is sm_{host_sm} "
                          f"(TensorRT: engine plan generated on an incompatible device): {tag}")
    if _SERIAL.search(text):
        built = data.get("tensorrt") or "another version"
        return GuardError(f"engine serialised by TensorRT {built} cannot be read by this host's TensorRT "
                          f"{facts.tensorrt or version()} (serialization version tag mismatch): {tag}")
    return None


# --- ONNX export (torch only) -----------------------------------------------------------------------

def export_onnx(model_dir: str, params: EngineParams, path: str | Path) -> Path:
    """fp32 ONNX of the embedding module (body + pooling + norm) with dynamic batch and seq axes;
    the TensorRT builder applies the precision flags."""
    import torch

    from .torch_common import build_module, tuned_example

    path = Path(path)
    module = build_module(model_dir, params, torch.float32, "cpu")
    example = tuned_example(params, "cpu", pad_left=params.pooling == "last")
    dynamic_axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                    OUTPUT: {0: "batch"}}
    kwargs = dict(input_names=list(INPUTS), output_names=[OUTPUT], opset_version=params.trt_opset)
    with torch.no_grad():
        try:
            torch.onnx.export(module, example, str(path), dynamic_axes=dynamic_axes, dynamo=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the TorchScript exporter is deprecated in newer torch
            log.warning("TorchScript ONNX export failed (%s); retrying with the dynamo exporter",
                        str(exc).splitlines()[0][:200])
            from torch.export import Dim

            batch, seq = Dim("batch", min=1, max=params.max_batch), Dim("seq", min=2, max=params.max_seq_len)
            shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
            torch.onnx.export(module, example, str(path), dynamo=True, dynamic_shapes=shapes,
                              external_data=False, **kwargs)
    return path


# --- TensorRT build and load ------------------------------------------------------------------------

class _Logger:
    """A tensorrt.ILogger that keeps the messages, so errors can be mapped to the guard's."""

    def __new__(cls, trt):
        class Impl(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.messages: list[str] = []

            def log(self, severity, msg):
                self.messages.append(str(msg))
                if severity <= trt.ILogger.Severity.WARNING:
                    log.warning("TensorRT: %s", msg)

        return Impl()


def _load_timing_cache(config, out_dir: Path, params: EngineParams) -> bytes:
    if not params.trt_timing_cache:
        return b""
    shared = os.environ.get(ENV_TIMING_CACHE)
    blob = Path(shared).read_bytes() if shared and Path(shared).is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return blob


def _save_timing_cache(config, out_dir: Path, params: EngineParams) -> None:
    if not params.trt_timing_cache:
        return
    data = bytes(config.get_timing_cache().serialize())
    (out_dir / TIMING_CACHE).write_bytes(data)
    shared = os.environ.get(ENV_TIMING_CACHE)
    if shared:
        tmp = Path(shared).with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, shared)


def build_engine(onnx_path: str | Path, params: EngineParams, out_dir: str | Path) -> dict:
    trt = _trt()
    out_dir = Path(out_dir)
    logger = _Logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, params.trt_workspace_mib << 20)
    for flag in builder_flag_values(trt, params):
        config.set_flag(flag)
    config.hardware_compatibility_level = hardware_level(trt, params)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile_shapes(params).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    _load_timing_cache(config, out_dir, params)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT build_serialized_network failed: " + " | ".join(logger.messages[-5:]))
    (out_dir / ARTIFACT).write_bytes(bytes(plan))
    _save_timing_cache(config, out_dir, params)
    return {"flags": list(precision_flags(params.precision)), "profile": profile_shapes(params)}


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    import torch

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="mopt-onnx-") as tmp:
        onnx_path = export_onnx(model_dir, params, Path(tmp) / "model.onnx")
        built = build_engine(onnx_path, params, out_dir)
    major, minor = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else (None, None)
    info = {"tensorrt": version(), "compute_capability": f"{major}.{minor}" if major is not None else None,
            "opset": params.trt_opset, "precision_flags": built["flags"],
            "profile": {k: [list(s) for s in v] for k, v in built["profile"].items()},
            "hardware_compatibility": params.trt_hardware_compatibility,
            "version_compatible": params.trt_version_compatible, "timing_cache": params.trt_timing_cache}
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    from transformers import AutoConfig

    return {"artifact": ARTIFACT, "export_dims": "onnx-dynamic",
            "embedding_dim": int(AutoConfig.from_pretrained(model_dir).hidden_size),
            "fingerprint": {"tensorrt_build": {"compute_capability": info["compute_capability"],
                                               "tensorrt": info["tensorrt"],
                                               "version_compatible": params.trt_version_compatible,
                                               "hardware_compatibility": params.trt_hardware_compatibility}}}


def deserialize(plan: bytes, params: EngineParams, data: dict | None = None):
    """The engine on the TensorRT runtime; a portability failure raises the guard's GuardError."""
    trt = _trt()
    logger = _Logger(trt)
    runtime = trt.Runtime(logger)
    if params.trt_version_compatible:
        runtime.engine_host_code_allowed = True  # the plan embeds its lean runtime
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        text = " ".join(logger.messages)
        from ..hostinfo import host_facts

        err = map_error(text, data, host_facts())
        if err is not None:
            raise err
        raise RuntimeError(f"TensorRT could not deserialise the engine: {text[-500:]}")
    return engine


def load(engine_dir: str | Path, params: EngineParams):
    import torch

    engine_dir = Path(engine_dir)
    data = None
    meta = engine_dir.parent / "engine.json"
    if meta.is_file():
        data = json.loads(meta.read_text())
    engine = deserialize((engine_dir / ARTIFACT).read_bytes(), params, data)
    context = engine.create_execution_context()
    stream = torch.cuda.Stream()

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        ids, mask = input_ids.cuda().contiguous(), attention_mask.cuda().contiguous()
        context.set_input_shape("input_ids", tuple(ids.shape))
        context.set_input_shape("attention_mask", tuple(mask.shape))
        out = torch.empty(tuple(context.get_tensor_shape(OUTPUT)), dtype=torch.float32, device="cuda")
        for name, tensor in (("input_ids", ids), ("attention_mask", mask), (OUTPUT, out)):
            context.set_tensor_address(name, tensor.data_ptr())
        with torch.cuda.stream(stream):
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        return out.cpu()

    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    from .torch_common import eager_reference

    return eager_reference(model_dir, texts, params)


def prepare(device: str) -> None:
    """Nothing to warm before the load."""


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
    raise UsageError("tensorrt engines are served by mopt's own server, not exec_serve")


def which_trtexec() -> str | None:
    return shutil.which("trtexec")
