"""Engine backends: the contract every backend module fulfils, and the one registry of them.

A backend is a module of this package that defines every function of EngineBackend, including the
ones its capabilities make trivial (prepare, exec_serve), so callers never probe for attributes. Its
capabilities are declared in registry.py, so the server process can decide how to serve
without importing the backend (torch, vLLM ...). Code the torch backends share lives in
torch_common.py; a backend never imports another backend or the guard (tests/unit/test_boundaries.py).

Adding a backend: docs/backends.md has the checklist (this registry is one line of it).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .registry import BACKENDS, FLOAT_PRECISIONS, BackendInfo, backend_info  # noqa: F401  (the package's API)

if TYPE_CHECKING:  # params imports registry.py, not this package: no import cycle
    from ..params import EngineParams

# Embeddings for a padded batch: (input_ids, attention_mask) -> float32 [batch, dim], or for a packed one
# (params.input_form "packed"): (input_ids, seq_lengths, max_len) -> [sequences, dim]. A call whose forward
# passes run in a process of the backend's own (vllm's InProcess: EngineCore) also has alive(), exitcode() and
# close(), which engine.Engine passes on.
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


def dense_packing(params: EngineParams) -> bool:
    """Whether this engine's packed calls of equal lengths go as [sequences, length] (packed.py)."""
    return params.packed and params.device in backend_info(params.backend).packed_dense


def get_backend(name: str) -> EngineBackend:
    """The backend module for NAME, imported on first use (backends import torch, TensorRT, vLLM ...)."""
    module = importlib.import_module(f".{backend_info(name).module}", __name__)
    if not isinstance(module, EngineBackend):
        raise TypeError(f"backend module {module.__name__} does not define every EngineBackend function "
                        "(see builder/runtime/backends/__init__.py)")
    return module
