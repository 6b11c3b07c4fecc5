"""Which SDPA (attention) kernels a compiled CUDA graph may use, for the backends that compile
through Inductor (torch-inductor, torch-aot).

cuDNN's kernel is left out by default: it generates and compiles a kernel plan for each new input
shape at first use, a stall on every new request shape with dynamic shapes (docs/performance.md).
MOPT_SDPA_BACKENDS overrides the list (benchmarks set it to compare).
"""
from __future__ import annotations

import os

from .errors import UsageError

ENV_SDPA = "MOPT_SDPA_BACKENDS"
SDPA_DEFAULT = "flash,efficient,math"
SDPA_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH",
              "cudnn": "CUDNN_ATTENTION"}


def sdpa_backends() -> list[str]:
    names = [n.strip() for n in os.environ.get(ENV_SDPA, SDPA_DEFAULT).split(",") if n.strip()]
    unknown = [n for n in names if n not in SDPA_NAMES]
    if unknown or not names:
        raise UsageError(f"{ENV_SDPA}: {','.join(unknown) or '(empty)'} not among {', '.join(SDPA_NAMES)}")
    return names


def sdpa_kernels():
    """Context restricting which SDPA kernel tracing and compiling bake into the graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_NAMES[n]) for n in sdpa_backends()], set_priority=True)


def sdpa_summary(graph) -> dict:
    """What a traced graph's attention calls are: how many, and how many still take a mask tensor
    (with attention "causal" there must be none, else SDPA's flash kernel is out)."""
    calls = [n for n in graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    return {"sdpa_backends": sdpa_backends(), "sdpa_calls": len(calls),
            "sdpa_with_mask": sum(1 for n in calls if len(n.args) > 3 and n.args[3] is not None)}
