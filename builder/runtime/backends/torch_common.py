"""What the torch backends share (torch-aot, torch-inductor; tensorrt exports ONNX from the same module
and every backend's accuracy reference is the eager model): building the embedding module, the
example inputs whose sizes Inductor tunes for, torch.export with dynamic dims, Inductor options and
the fp32 eager reference, and loading an engine in a fresh process.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..errors import UsageError
from ..packed import PackedEmbeddingModule, pack
from ..params import EngineParams
from ..pooling import EmbeddingModule, load_body
from ..rotary import rotary_as_product
from ..tokenization import TextEncoder
from . import dense_packing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


def build_module(model_dir: str, params: EngineParams, dtype: torch.dtype, device: str,
                 model_rotary: bool = False) -> EmbeddingModule | PackedEmbeddingModule:
    attention = "packed" if params.packed else params.attention
    return wrap_body(load_body(model_dir, dtype, device, attention), params, model_rotary)


def wrap_body(body, params: EngineParams, model_rotary: bool = False) -> EmbeddingModule | PackedEmbeddingModule:
    """A transformers body as the embedding module the engine params describe; its rotary tables as a
    product (rotary.py: same values, fusible) unless model_rotary (the model as transformers runs it)."""
    if hasattr(body.config, "use_cache"):
        body.config.use_cache = False  # no KV cache objects in an embedding graph
    if not model_rotary:
        rotary_as_product(body)
    if params.packed:
        return PackedEmbeddingModule(body, params.pooling, params.normalize, dense_packing(params))
    return EmbeddingModule(body, params.pooling, params.normalize, left_padded=params.pad_left)


ENV_TUNE_SHAPE = "MOPT_TUNE_SHAPE"  # BATCHxSEQ the compile tunes kernels for; default the largest


def tune_shape(params: EngineParams) -> tuple[int, int]:
    """The example shape the graph is exported with. Both dims stay dynamic, but its sizes are the
    hints Inductor tunes kernels for (block sizes of fused kernels, GEMM choices): by default the
    largest batch, the one that decides throughput. Batch >= 2 keeps export from specialising it to 1."""
    b, s = params.max_batch, params.max_seq_len
    raw = os.environ.get(ENV_TUNE_SHAPE, "").strip()
    if raw:
        parts = raw.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise UsageError(f"{ENV_TUNE_SHAPE}={raw!r}: expected BATCHxSEQ, e.g. 64x512")
        b, s = int(parts[0]), int(parts[1])
        low_b = 2 if params.max_batch > 1 else 1
        if not (low_b <= b <= params.max_batch and 2 <= s <= params.max_seq_len):
            raise UsageError(f"{ENV_TUNE_SHAPE}={raw!r}: batch must be {low_b}..{params.max_batch} and "
                             f"sequence 2..{params.max_seq_len} (the engine's max_batch and max_seq_len)")
    return b, s


def tuned_example(params: EngineParams, device: str, pad_left: bool):
    """Example inputs at the shape the kernels are tuned for (tune_shape)."""
    if params.packed:
        return packed_example(*tune_shape(params), params.batch_tokens, device, dense_packing(params))
    return example_inputs(*tune_shape(params), device, pad_left)


def packed_example(b: int, s: int, budget: int, device: str, dense: bool):
    """A packed call of up to b sequences of length s within the token budget. Dense engines: every
    sequence as long (input_ids [rows, length]), so no dim of the example is 1, which tracing would
    specialise; the graph traces the mixed branch as well (packed.py). Others: one stream [1, tokens],
    the second sequence half as long, so sequences of different lengths are traced."""
    lengths = [s] * max(2, min(b, budget // s))
    if not dense:
        lengths[1] = max(1, s // 2)
    return tuple(t.to(device) for t in pack([[1] * n for n in lengths], dense))


def call_example(params: EngineParams, device: str = "cpu"):
    """Small inputs of the engine's form, for a first call (2 x 16, or less)."""
    b, s = min(2, params.max_batch), min(16, params.max_seq_len)
    if params.packed:
        return packed_example(b, s, params.batch_tokens, device, dense_packing(params))
    return example_inputs(b, s, device, params.pad_left)


def example_inputs(b: int, s: int, device: str, pad_left: bool):
    """ids and mask of shape (b, s); row 1 half padded (left or right) so padding paths are traced."""
    ids = torch.ones(b, s, dtype=torch.long, device=device)
    mask = torch.ones(b, s, dtype=torch.long, device=device)
    if b > 1:
        if pad_left:
            mask[1, : s // 2] = 0
        else:
            mask[1, s // 2:] = 0
    return ids, mask


def export_graph(module, example, params: EngineParams, strip_asserts: bool = True):
    """torch.export with dynamic batch and sequence dims: (ExportedProgram, how the dims were given)."""
    exported, dims = _export_dynamic(module, example, params)
    if strip_asserts:
        strip_dtype_asserts(exported)
    return exported, dims


def strip_dtype_asserts(exported) -> None:
    """Drop the aten._assert_tensor_metadata nodes export puts before each .to(dtype). Inductor
    lowers them to nothing, but as extra users of a tensor they can stop it fusing an RMSNorm's
    reduction with its normalisation (each attention block's per-head q/k norms split into two
    kernels; tests/unit/test_runtime_qwen3.py shows it on the CPU)."""
    graph = exported.graph_module.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"
             and n.target is torch.ops.aten._assert_tensor_metadata.default and not n.users]
    for node in nodes:
        graph.erase_node(node)
    exported.graph_module.recompile()


def _export_dynamic(module, example, params: EngineParams):
    from torch.export import Dim

    if params.packed:  # every dim from 1: a call may hold one sequence of one token
        row_len = Dim("row_len", min=1, max=params.batch_tokens)
        rows = Dim("rows", min=1, max=params.max_batch) if dense_packing(params) else None
        dims = {"input_ids": {0: rows, 1: row_len} if rows else {1: row_len},
                "seq_lengths": {0: Dim("sequences", min=1, max=params.max_batch)},
                "max_len": {0: Dim("longest", min=1, max=params.max_seq_len)}}
        return torch.export.export(module, example, dynamic_shapes=dims, strict=False), "packed"
    dyn_batch = params.max_batch > 1
    batch = Dim("batch", min=1, max=params.max_batch) if dyn_batch else None
    seq = Dim("seq", min=2, max=params.max_seq_len)
    explicit = {"input_ids": {0: batch, 1: seq} if dyn_batch else {1: seq},
                "attention_mask": {0: batch, 1: seq} if dyn_batch else {1: seq}}
    try:
        return torch.export.export(module, example, dynamic_shapes=explicit, strict=False), "explicit"
    except Exception as exc:  # which explicit ranges export accepts differs by torch version
        log.warning("export with explicit Dim ranges failed (%s); retrying with Dim.AUTO",
                    str(exc).splitlines()[0][:200])
        auto = {k: {0: Dim.AUTO, 1: Dim.AUTO} for k in ("input_ids", "attention_mask")}
        return torch.export.export(module, example, dynamic_shapes=auto, strict=False), "auto"


ENV_INDUCTOR_OPTIONS = "MOPT_INDUCTOR_OPTIONS"  # JSON object of extra Inductor config, e.g. {"triton.max_tiles": 1}


def inductor_options(mode: str) -> dict:
    """Inductor config patches of a compile mode, without CUDA graphs (engines are plain callables),
    plus MOPT_INDUCTOR_OPTIONS (checked against this torch's Inductor config names)."""
    patches = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    patches.pop("triton.cudagraphs", None)
    raw = os.environ.get(ENV_INDUCTOR_OPTIONS, "").strip()
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError as exc:
            raise UsageError(f"{ENV_INDUCTOR_OPTIONS}: not JSON ({exc})") from None
        if not isinstance(extra, dict):
            raise UsageError(f"{ENV_INDUCTOR_OPTIONS}: expected a JSON object of Inductor config names and values")
        known = torch._inductor.config.get_config_copy()
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise UsageError(f"{ENV_INDUCTOR_OPTIONS}: not Inductor config names in torch {torch.__version__}: "
                             f"{', '.join(unknown)}")
        patches.update(extra)
    return patches


def eager_reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    """fp32 eager embeddings, one text at a time (no padding), the ground truth for accuracy."""
    enc = TextEncoder(model_dir, params.pooling, params.instruction)
    # The model's own attention (no padding here): the reference does not depend on the engine's choice.
    # The model as transformers runs it: the reference checks the engine's graph changes too (rotary.py).
    module = build_module(model_dir, replace(params, attention="mask", input_form="padded"), torch.float32, "cpu",
                          model_rotary=True)
    out = []
    with torch.no_grad():
        for ids in enc.encode(texts):
            t = torch.tensor([ids], dtype=torch.long)
            out.append(module(t, torch.ones_like(t))[0].tolist())
    return out


# Run by load_in_fresh_process in a child: a backend's load() of an engine dir, as served, called once.
_FRESH_LOAD = """
import importlib, json, sys
backend = importlib.import_module(sys.argv[3])
common = importlib.import_module(sys.argv[3].rpartition(".")[0] + ".torch_common")
params = backend.EngineParams.from_dict(json.loads(sys.argv[2]))
run = backend.load(sys.argv[1], params)
out = run(*common.call_example(params))
print("LOADED", getattr(backend, "LAST_LOAD_PATH", None), tuple(out.shape))
"""


def load_in_fresh_process(backend_module: str, engine_dir: Path, params: EngineParams, env: dict | None = None,
                          timeout: float = 900) -> subprocess.CompletedProcess:
    """BACKEND_MODULE's load() of ENGINE_DIR and one call, in a fresh interpreter: a crash or a build at
    load shows at compile time, not at a container's start. Its stdout has "LOADED <LAST_LOAD_PATH>
    <shape>" when the call returned. The module goes by its own name (builder.runtime... here,
    mopt_runtime... in images), importable from the dir above the package."""
    root = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", _FRESH_LOAD, str(engine_dir), json.dumps(params.to_dict()),
                           backend_module], capture_output=True, text=True, env=env, timeout=timeout)
