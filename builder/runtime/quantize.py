"""int8 engines on the CPU: every linear layer of the body as an int8 matrix product.

Weights are quantized once, symmetrically per output channel (scale = the row's largest |w| / 127);
activations at run time, symmetrically per token (each row of the input its own scale), so a long text
and a short one in the same call do not share a range. The product runs as int8 x int8 -> int32
(torch._int_mm: oneDNN's VNNI kernels on x86) and is scaled back to fp32, where the bias, the layer
norms, the attention and the pooling stay. Embedding tables stay fp32: they are looked up, not
multiplied.

Per-token scales alone lose the short texts: a few hidden channels of the special tokens ([CLS], [SEP])
are tens of times larger than the rest, and a token's one scale then leaves its other channels a few
levels each (all-MiniLM-L6-v2: min cosine 0.990 against fp32 on the gate's texts, all of it on 3-4
token texts). So the layers are smoothed first (SmoothQuant, Xiao et al. 2023): each input channel j
of a layer is divided by s_j = max|x_j|^0.5 / max|w_j|^0.5 and the weight's column j multiplied by it,
the same product in exact arithmetic, with the activations' outliers moved into the weights, which are
quantized per output channel and take them well. max|x_j| comes from a calibration pass of the fp32
model over CALIBRATION_TEXTS (fixed here, apart from the gate's texts, so the gate still judges text
the calibration never saw): min cosine 0.9948, mean 0.9981 on MiniLM. The division is one multiply
that Inductor fuses into the activation's quantization.

Written here rather than taken from torchao, measured side by side (benchmarks/int8_cpu.py, docs/
performance.md "int8 on the CPU"): torchao's Int8DynamicActivationInt8WeightConfig exports and compiles
through AOTInductor too, but it does not smooth (MiniLM: min cosine 0.989 on the gate's texts, below the
recipe's 0.99), ran at 0.96-1.28x fp32 where this runs at 2.3-2.4x, and importing it costs 1.2-1.3 s
and warns about its CUDA extensions in a CPU image. Its weight-only int8 ran at 0.67-0.81x fp32.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

QMAX = 127  # symmetric int8: -127..127 (-128 unused, so negation never overflows)
_EPS = 1e-12  # an all-zero row or channel: scale 1e-12/127, its values quantize to 0
SMOOTHING = 0.5  # SmoothQuant's alpha: how much of each channel's range moves into the weights
_RANGE_FLOOR = 1e-5  # a channel never seen non-zero (or a zero weight column) is not divided by ~0
# Calibration: a few sentences in several scripts and of several lengths, down to one word (the special
# tokens' outliers matter most there). None of them is a gate text (gate.py).
CALIBRATION_TEXTS = (
    "The weather in Paris is mild in spring.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "机器学习模型需要大量的数据。",
    "Hi",
    "A",
    "What is the capital of France?",
    "El gato duerme en la silla.",
    "Containers ship inference engines to GPU hosts; each image carries its compiled engine.",
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] as int8 values and one fp32 scale per row: x ~= q * scale."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / QMAX
    q = torch.round(x / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def smoothing_factors(input_range: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|w_j|^(1-alpha) per input channel j (SmoothQuant)."""
    w_range = weight.abs().amax(dim=0).clamp(min=_RANGE_FLOOR)
    return input_range.clamp(min=_RANGE_FLOOR) ** alpha / w_range ** (1 - alpha)


class Int8Linear(torch.nn.Module):
    """A linear layer computed as int8 x int8 -> int32, scaled back to fp32 (see the module's doc).
    input_range: each input channel's largest |x| seen in calibration (None: no smoothing)."""

    def __init__(self, linear: torch.nn.Linear, input_range: torch.Tensor | None = None):
        super().__init__()
        weight = linear.weight.detach().float()
        smooth = (smoothing_factors(input_range.float(), weight) if input_range is not None
                  else torch.ones(linear.in_features))
        q, scale = quantize_rows(weight * smooth)  # per output channel, the columns smoothed
        self.register_buffer("input_divisor", smooth.reciprocal().contiguous())  # multiplied: one fused op
        self.register_buffer("weight_int8", q.t().contiguous())  # [in, out], as _int_mm takes it
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float() * self.input_divisor
        q, scale = quantize_rows(rows)
        y = torch._int_mm(q, self.weight_int8).float() * (scale * self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel x per token"


def _linears(module: torch.nn.Module):
    """(qualified name, parent, attribute, layer) of every torch.nn.Linear under MODULE."""
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                yield f"{parent_name}.{name}" if parent_name else name, parent, name, child


def input_ranges(module: torch.nn.Module, run: Callable[[], Iterable]) -> dict[str, torch.Tensor]:
    """Each linear layer's largest |input| per channel while RUN calls MODULE (the calibration pass)."""
    ranges: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_layer, inputs, _output):
            seen = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(dim=0).float()
            ranges[name] = torch.maximum(ranges[name], seen) if name in ranges else seen
        return hook

    hooks = [layer.register_forward_hook(record(name)) for name, _, _, layer in _linears(module)]
    try:
        with torch.no_grad():
            for _ in run():
                pass
    finally:
        for h in hooks:
            h.remove()
    return ranges


def quantize_linears(module: torch.nn.Module, ranges: dict[str, torch.Tensor] | None = None) -> int:
    """Replace every torch.nn.Linear under MODULE by an Int8Linear, in place, smoothed by RANGES (from
    input_ranges over the same module) where given; returns how many."""
    replaced = 0
    for name, parent, attribute, layer in list(_linears(module)):
        setattr(parent, attribute, Int8Linear(layer, (ranges or {}).get(name)))
        replaced += 1
    return replaced
