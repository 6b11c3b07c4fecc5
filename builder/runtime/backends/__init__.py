"""Engine backends: the contract every backend module fulfils, and the one registry of them.

A backend is a module of this package that defines every function of EngineBackend, including the
ones its capabilities make trivial (prepare, exec_serve), so callers never probe for attributes. Its
capabilities are declared here, in its registry entry, so the server process can decide how to serve
without importing the backend (torch, vLLM ...). Code the torch backends share lives in
torch_common.py; a backend never imports another backend or the guard (tests/unit/test_boundaries.py).

Adding a backend: docs/backends.md has the checklist (this registry is one line of it).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import UsageError

if TYPE_CHECKING:  # params validates against this registry: no import cycle at run time
    from ..params import EngineParams

FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")

# Embeddings for a padded batch: (input_ids, attention_mask) -> float32 [batch, dim], or for a packed one
# (params.input_form "packed"): (input_ids, seq_lengths, max_len) -> [sequences, dim]. A call backed by a
# server child (vllm's Server) also has alive(), exitcode() and close(), which engine.Engine passes on.
EngineCall = Callable[[Any, Any], Any]


@runtime_checkable
class EngineBackend(Protocol):
    """The functions a backend module defines."""

    def version(self) -> str:
        """The backend's version in this environment ("not-installed" when it is absent)."""

    def compile(self, model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
        """Write the engine into out_dir; return {"artifact", "embedding_dim", "export_dims", "fingerprint"?}."""

    def load(self, engine_dir: str | Path, params: EngineParams) -> EngineCall:
        """The compiled engine as a callable (tensorrt-llm raises: trtllm-serve loads its engine)."""

    def reference(self, model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
        """fp32 eager embeddings of texts, the accuracy ground truth ([] for a chat model)."""

    def prepare(self, device: str) -> None:
        """Start-up work that needs no engine file, overlapped with the guard's hashing (a no-op unless
        the registry says `prepares`)."""

    def exec_serve(self, out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
        """Replace this process with the backend's own server (own_server only; others raise UsageError)."""


@dataclass(frozen=True, kw_only=True)
class BackendInfo:
    module: str  # the module of this package that implements EngineBackend
    own_server: bool  # served by its own OpenAI server (exec_serve after the guard), not by mopt's server
    version_is_torch: bool  # its version is torch's, which the guard compares already
    prepares: bool  # prepare() does start-up work worth overlapping with the guard's hashing
    precisions: tuple[str, ...] = FLOAT_PRECISIONS  # what --precision may be
    causal_attention: bool = False  # takes --attention causal (right padding, SDPA's is_causal)
    unpadded: bool = False  # drops the padding itself (vLLM packs sequences): calls are cut by row count only
    packed_input: bool = False  # compiles --input packed engines (one token stream per call: packed.py)
    # Devices where its packed graph takes a call of equal lengths as [sequences, length], with dense
    # attention (torch.cond in the graph); elsewhere every call is one stream. None today: the exported
    # graph is exact, but AOTInductor miscompiles it (CUDA, torch 2.11: Qwen3 and BERT shapes; CPU,
    # torch 2.13: the Qwen3 decoder, cosine 0.71-0.81, though MiniLM was exact), and torch-inductor's
    # standalone artifact cannot save it ("no artifact to save"). docs/performance.md, "Dense
    # attention for uniform calls".
    packed_dense: tuple[str, ...] = ()


# The one place a backend is registered (the host side describes it in builder/data/backends/<name>.yaml).
BACKENDS: dict[str, BackendInfo] = {
    "torch-aot": BackendInfo(module="torch_aot", own_server=False, version_is_torch=True, prepares=False,
                             causal_attention=True, packed_input=True),
    "torch-inductor": BackendInfo(module="torch_inductor", own_server=False, version_is_torch=True, prepares=True,
                                  causal_attention=True, packed_input=True),
    # int8 and fp8 are TensorRT builder flags (fp16 kernels as the fallback).
    "tensorrt": BackendInfo(module="tensorrt", own_server=False, version_is_torch=False, prepares=False,
                            precisions=(*FLOAT_PRECISIONS, "int8", "fp8")),
    "tensorrt-llm": BackendInfo(module="tensorrt_llm", own_server=True, version_is_torch=False, prepares=False),
    # vLLM's own server runs behind mopt's, as the engine (load starts it): one API for every flavour.
    "vllm": BackendInfo(module="vllm_backend", own_server=False, version_is_torch=False, prepares=False,
                        unpadded=True),
}


def dense_packing(params: EngineParams) -> bool:
    """Whether this engine's packed calls of equal lengths go as [sequences, length] (packed.py)."""
    return params.packed and params.device in backend_info(params.backend).packed_dense


def backend_info(name: str) -> BackendInfo:
    """A backend's capabilities, without importing it."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None


def get_backend(name: str) -> EngineBackend:
    """The backend module for NAME, imported on first use (backends import torch, TensorRT, vLLM ...)."""
    module = importlib.import_module(f".{backend_info(name).module}", __name__)
    if not isinstance(module, EngineBackend):
        raise TypeError(f"backend module {module.__name__} does not define every EngineBackend function "
                        "(see builder/runtime/backends/__init__.py)")
    return module
