"""Engine backends: one module each, same three functions.

compile(model_dir, params, out_dir) -> dict of fingerprint fields
load(engine_dir, params) -> callable(input_ids, attention_mask) -> float32 embeddings
reference(model_dir, texts, params) -> list[list[float]] (fp32 eager transformers)
"""
from __future__ import annotations

import importlib

from ..errors import UsageError

BACKENDS = {"torch-aot": "torch_aot", "tensorrt": "tensorrt", "tensorrt-llm": "tensorrt_llm", "vllm": "vllm_backend"}
# CUDA engine while AOTInductor .pt2 loading segfaults there (torch 2.11+cu130 on the H200)
BACKENDS["torch-compile-cache"] = "torch_compile_cache"


def get_backend(name: str):
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return importlib.import_module(f".{BACKENDS[name]}", __name__)
