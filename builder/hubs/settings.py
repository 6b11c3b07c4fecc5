"""What every hub client shares: the files an engine reads, and a hub's settings from the environment.
(A module of its own so the clients never import the package that picks them: no import cycle.)"""
from __future__ import annotations

import os
from dataclasses import dataclass

# What the engines read: config, tokenizer, weights as safetensors, sentence-transformers pooling, the
# model card (for its license). Not the ONNX/OpenVINO/PyTorch-pickle copies many repos also carry.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "1_Pooling/*", "README.md")
IGNORE_PATTERNS = ("onnx/*", "openvino/*", "*.onnx", "*.onnx_data", "*.bin", "*.h5", "*.msgpack", "*.ot")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    token: str | None  # never printed: repr hides it
    offline: bool

    def __repr__(self) -> str:
        shown = "set" if self.token else None
        return f"HubSettings(endpoint={self.endpoint!r}, token={shown}, offline={self.offline})"


def offline_from_env(*names: str) -> bool:
    return any(os.environ.get(name, "").lower() in _TRUE for name in (*names, "MOPT_OFFLINE"))
