"""The registry of engine backends: each one's capabilities, readable without importing the backend
(torch, vLLM ...) or the engine parameters (params.py validates against it). A backend is described
once, in <name>.yaml beside this file: the host's half (plan, render) and the runtime's (`runtime:`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import UsageError

FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")
# What a backend's engines may be compiled in where its description says nothing: half precision only on
# CUDA (on CPU it is slow, and its accuracy against the fp32 reference was never measured there).
DEFAULT_PRECISIONS = {"cpu": ("fp32",), "cuda": FLOAT_PRECISIONS}


@dataclass(frozen=True, kw_only=True)
class BackendInfo:
    module: str  # the module of this package that implements EngineBackend
    own_server: bool  # served by its own OpenAI server (exec_serve after the guard), not by mopt's server
    version_is_torch: bool  # its version is torch's, which the guard compares already
    prepares: bool  # prepare() does start-up work worth overlapping with the guard's hashing
    cpu_precisions: tuple[str, ...] = DEFAULT_PRECISIONS["cpu"]  # what --precision may be on each device
    cuda_precisions: tuple[str, ...] = DEFAULT_PRECISIONS["cuda"]
    causal_attention: bool = False  # takes --attention causal (right padding, SDPA's is_causal)
    unpadded: bool = False  # drops the padding itself (vLLM packs sequences): calls are cut by row count only
    # Takes several calls at once and batches them itself (vLLM's scheduler; its forward passes run in
    # its own process): served in-process, the calls in flight (--engine-depth) run side by side.
    concurrent_calls: bool = False
    packed_input: bool = False  # compiles --input packed engines (one token stream per call: packed.py)
    # Devices where its packed graph takes a call of equal lengths as [sequences, length], with dense
    # attention (torch.cond in the graph); elsewhere every call is one stream. None today: the exported
    # graph is exact, but AOTInductor miscompiles it (CUDA, torch 2.11: Qwen3 and BERT shapes; CPU,
    # torch 2.13: the Qwen3 decoder, cosine 0.71-0.81, though MiniLM was exact), and torch-inductor's
    # standalone artifact cannot save it ("no artifact to save"). docs/performance.md, "Dense
    # attention for uniform calls".
    packed_dense: tuple[str, ...] = ()

    def precisions(self, device: str) -> tuple[str, ...]:
        return self.cpu_precisions if device == "cpu" else self.cuda_precisions


def _load(directory: Path) -> dict[str, BackendInfo]:
    """The registry from the backends' descriptions (<name>.yaml beside this file, one per backend: the
    host validates them against builder/schemas/backend.schema.json and reads the same files)."""
    registry = {}
    for path in sorted(directory.glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        own = data["runtime"]
        registry[data["name"]] = BackendInfo(
            module=own["module"], own_server=data["own_server"], version_is_torch=own["version_is_torch"],
            prepares=own["prepares"],
            **{f"{device}_precisions": tuple(own.get("precisions", {}).get(device, default))
               for device, default in DEFAULT_PRECISIONS.items()},
            causal_attention=own.get("causal_attention", False), unpadded=own.get("unpadded", False),
            concurrent_calls=own.get("concurrent_calls", False),
            packed_input=bool(data.get("input_forms")),  # a packed default only where packed engines compile
            packed_dense=tuple(own.get("packed_dense", ())))
    return registry


DESCRIPTIONS = Path(__file__).parent
BACKENDS: dict[str, BackendInfo] = _load(DESCRIPTIONS)


def backend_info(name: str) -> BackendInfo:
    """A backend's capabilities, without importing it."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None
