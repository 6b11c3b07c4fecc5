"""Engine backends: one module each, same three functions.

compile(model_dir, params, out_dir) -> dict of fingerprint fields
load(engine_dir, params) -> callable(input_ids, attention_mask) -> float32 embeddings
reference(model_dir, texts, params) -> list[list[float]] (fp32 eager transformers)
"""
from __future__ import annotations

import importlib

from ..errors import UsageError

# torch-aot (.pt2, C++) is the CUDA engine of the aot flavours; torch-inductor (Python wrapper + Triton
# kernels) is the alternative form, with a slower start (docs/performance.md).
BACKENDS = {"torch-aot": "torch_aot", "torch-inductor": "torch_inductor", "tensorrt": "tensorrt",
            "tensorrt-llm": "tensorrt_llm", "vllm": "vllm_backend"}
# These serve through their own OpenAI server (exec_serve) after the guard, not through ours.
BACKENDS_WITH_OWN_SERVER = ("tensorrt-llm", "vllm")


def get_backend(name: str):
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return importlib.import_module(f".{BACKENDS[name]}", __name__)
