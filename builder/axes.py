"""The matrix's axes, defined once: what a flavour may cross, fix or pick, in the order of crossing,
of JSON keys and of the long tag."""
from __future__ import annotations

AXES = ("cuda", "sm", "driver", "tensorrt", "tensorrt_llm", "vllm", "torch", "python", "base", "precision")
# What the compatibility check of versions takes: every axis but the base image and the engine's precision
# (which the plan checks against the backend's precisions and the knowledge base's precisions table).
COMBO_AXES = tuple(a for a in AXES if a not in ("base", "precision"))
# Package versions the compatibility check parses as versions (cuda, sm and driver have their own forms).
PACKAGE_AXES = ("tensorrt", "tensorrt_llm", "vllm", "torch", "python")
# The default long tag names each of these with its prefix, in this order, plus the build id.
LONG_TAG_PREFIXES = {"cuda": "cuda", "tensorrt": "trt", "tensorrt_llm": "trtllm", "vllm": "vllm", "torch": "torch",
                     "python": "py", "driver": "drv"}
