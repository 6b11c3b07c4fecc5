"""torch.export + AOTInductor package (engine/model.pt2), CPU and CUDA."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from ..params import EngineParams
from ..pooling import EmbeddingModule, load_body
from ..tokenization import TextEncoder

ARTIFACT = "model.pt2"
VERSION_IS_TORCH = True  # the guard's torch check covers the backend version
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
log = logging.getLogger(__name__)


def version() -> str:
    return torch.__version__


def build_module(model_dir: str, params: EngineParams, dtype: torch.dtype, device: str) -> EmbeddingModule:
    return wrap_body(load_body(model_dir, dtype, device, params.attention), params)


def wrap_body(body, params: EngineParams) -> EmbeddingModule:
    """A transformers body as the embedding module the engine params describe."""
    if hasattr(body.config, "use_cache"):
        body.config.use_cache = False  # no KV cache objects in an embedding graph
    return EmbeddingModule(body, params.pooling, params.normalize, left_padded=params.pad_left)


def _example(params: EngineParams, device: str, pad_left: bool):
    # Batch 2 and a non-trivial length keep export from specialising either dim to 0/1.
    b, s = min(2, params.max_batch) if params.max_batch > 1 else 1, min(16, params.max_seq_len)
    return example_inputs(b, s, device, pad_left)


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


def _export(module, example, params: EngineParams):
    from torch.export import Dim

    dyn_batch = params.max_batch > 1
    batch = Dim("batch", min=1, max=params.max_batch) if dyn_batch else None
    seq = Dim("seq", min=2, max=params.max_seq_len)
    explicit = {"input_ids": {0: batch, 1: seq} if dyn_batch else {1: seq},
                "attention_mask": {0: batch, 1: seq} if dyn_batch else {1: seq}}
    try:
        return torch.export.export(module, example, dynamic_shapes=explicit, strict=False), "explicit"
    except Exception as exc:  # constraint violations differ by torch version (seen on 2.11+cu130)
        log.warning("export with explicit Dim ranges failed (%s); retrying with Dim.AUTO",
                    str(exc).splitlines()[0][:200])
        auto = {k: {0: Dim.AUTO, 1: Dim.AUTO} for k in ("input_ids", "attention_mask")}
        return torch.export.export(module, example, dynamic_shapes=auto, strict=False), "auto"


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    dtype = DTYPES[params.precision]
    module = build_module(model_dir, params, dtype, params.device)
    example = _example(params, params.device, pad_left=params.pad_left)
    with torch.inference_mode(False), torch.no_grad():
        exported, dims = _export(module, example, params)
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / ARTIFACT))
    return {"artifact": Path(path).name, "export_dims": dims,
            "embedding_dim": int(module.body.config.hidden_size)}


def load(engine_dir: str | Path, params: EngineParams):
    runner = torch._inductor.aoti_load_package(str(Path(engine_dir) / ARTIFACT))
    device = params.device

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = runner(input_ids.to(device), attention_mask.to(device))
        return out.float().cpu()

    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    """fp32 eager embeddings, one text at a time (no padding), the ground truth for accuracy."""
    enc = TextEncoder(model_dir, params.pooling, params.instruction)
    # The model's own attention (no padding here): the reference does not depend on the engine's choice.
    module = build_module(model_dir, replace(params, attention="mask"), torch.float32, "cpu")
    out = []
    with torch.no_grad():
        for ids in enc.encode(texts):
            t = torch.tensor([ids], dtype=torch.long)
            out.append(module(t, torch.ones_like(t))[0].tolist())
    return out
