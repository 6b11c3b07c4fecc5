"""int8 engines on the CPU: every linear layer of the body as an int8 matrix product.

Weights are quantized once, symmetrically per output channel (scale = the row's largest |w| / 127);
activations at run time, symmetrically per token (each row of the input its own scale), so a long text
and a short one in the same call do not share a range. The product runs as int8 x int8 -> int32
(torch._int_mm: oneDNN's VNNI kernels on x86) and is scaled back to fp32, where the bias, the layer
norms, the attention and the pooling stay. Embedding tables stay fp32: they are looked up, not
multiplied.

Written here rather than taken from torchao: torchao's Int8DynamicActivationInt8WeightConfig exports
and compiles through AOTInductor too, and measured no faster on the 2-core CPU (benchmarks/int8_cpu.py),
while importing it (transformers imports it wherever it is installed) adds seconds to every start and
warns about its CUDA extensions in a CPU image. This is the same arithmetic in 40 lines that export as
plain aten ops (Inductor fuses each activation's quantization into the kernel before it).
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric int8: -127..127 (-128 unused, so negation never overflows)
_EPS = 1e-12  # an all-zero row or channel: scale 1e-12/127, its values quantize to 0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] as int8 values and one fp32 scale per row: x ~= q * scale."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / QMAX
    q = torch.round(x / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8Linear(torch.nn.Module):
    """A linear layer computed as int8 x int8 -> int32, scaled back to fp32 (see the module's doc)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight.detach().float())  # per output channel
        self.register_buffer("weight_int8", q.t().contiguous())  # [in, out], as _int_mm takes it
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        q, scale = quantize_rows(rows)
        y = torch._int_mm(q, self.weight_int8).float() * (scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel x per token"


def quantize_linears(module: torch.nn.Module) -> int:
    """Replace every torch.nn.Linear under MODULE by an Int8Linear, in place; returns how many."""
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Int8Linear(child))
                replaced += 1
    return replaced
