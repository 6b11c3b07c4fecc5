"""int8 engines on the CPU and fp8 engines on CUDA: every linear layer of the body as an int8 or fp8
matrix product.

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

fp8 (CUDA, sm_89 and newer: FP8 tensor cores) quantizes the same way, to float8_e4m3fn: weights once per
output channel, activations per token at run time (scale = the row's largest |x| / 448, clamped to
+-448 before the cast), the product torch._scaled_mm with those row-wise scales, which accumulates in
fp32 and scales, adds the bias and rounds to the body's bf16 in its epilogue; everything else stays
bf16. A layer whose dims are not multiples of 16 (_scaled_mm's) stays a bf16 Linear. fp8 is not
smoothed: e4m3's exponent gives every value the same relative precision (3 mantissa bits), so an outlier
channel no longer leaves the rest of its token a few levels, and moving range into the weights only
coarsens them. Measured on all-MiniLM-L6-v2 against fp32 on the gate's texts to 512 tokens (bf16 body on
the CPU, whose _scaled_mm takes the same fp8 operands and scales): min cosine 0.9907, mean 0.9954
unsmoothed; 0.9888, 0.9947 smoothed (alpha 0.5, CALIBRATION_TEXTS); to 128 tokens 0.9923 / 0.9961
unsmoothed, 0.9926 / 0.9958 smoothed. The loss is spread over the layers (keeping any one kind of
layer in bf16 lifts the min by at most 0.004), not in a few outlier channels that smoothing would move.

fp8 with static activation scales (MOPT_FP8_SCALES=static at compile time): each layer's input gets one
scale for the whole tensor, its largest |x| over the calibration pass / 448, fixed at compile time, so
quantizing the input is a multiply, a clamp and a cast, which Inductor fuses into the kernel that
produced the input; the dynamic form's per-token amax is a reduction pass of its own before each GEMM
(the H100 profile in docs/performance.md: 4.2 ms of a 27 ms call after the MLP's SiLU alone). Weights
stay per output channel, so the product is _scaled_mm's row-wise form with the static scale folded into
the weights' scales and a column of ones as the input's. On all-MiniLM-L6-v2 against fp32 on the CPU,
the two forms are close and neither always better: to 512 tokens static 0.9921 min / 0.9954 mean against
dynamic 0.9907 / 0.9954; to 256 tokens (its weights stored in fp16) static 0.9904 against 0.9917. Static
per-tensor scales for the weights too (_scaled_mm's tensor-wise form) lose more: 0.9893 / 0.9944. Inputs
past the calibrated range saturate at +-448. Opt-in: compiled for CUDA, MiniLM's static engine fell below
its 0.99 gate (0.9877; eager on CUDA 0.9911), where the dynamic one passes (docs/performance.md).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from .errors import UsageError

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


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_ALIGN = 16  # _scaled_mm takes fp8 operands whose inner and outer dims are multiples of 16


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] as float8_e4m3fn values and one fp32 scale per row: x ~= q * scale. Clamped to +-448
    before the cast: what a cast does past the largest finite value differs across torch versions."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=_EPS) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


FP8_SCALES_ENV = "MOPT_FP8_SCALES"
FP8_SCALES = ("dynamic", "static")


def fp8_scales() -> str:
    """How an fp8 engine scales its layers' inputs: "dynamic" (per token, at run time; the default) or
    "static" (per tensor, calibrated at compile time), from MOPT_FP8_SCALES."""
    value = os.environ.get(FP8_SCALES_ENV, "dynamic")
    if value not in FP8_SCALES:
        raise UsageError(f"{FP8_SCALES_ENV} must be one of {', '.join(FP8_SCALES)}, not {value!r}")
    return value


class Fp8Linear(torch.nn.Module):
    """A linear layer of a bf16 or fp16 model computed as fp8 (e4m3) x fp8 with fp32 accumulation, scaled
    back, the bias added and the sum rounded to the input's dtype in the product's epilogue (see the
    module's doc). Not smoothed: on MiniLM smoothing did not help fp8 (the module's doc).
    input_range: the largest |input| of the calibration pass, for a static input scale (None: per token
    at run time)."""

    def __init__(self, linear: torch.nn.Linear, input_range: float | None = None):
        super().__init__()
        if linear.weight.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"an fp8 layer replaces a bf16 or fp16 linear layer, not {linear.weight.dtype}")
        if not fp8_fits(linear):
            raise ValueError(f"_scaled_mm needs dims that are multiples of {FP8_ALIGN}, not "
                             f"{linear.in_features} -> {linear.out_features}")
        q, scale = quantize_rows_fp8(linear.weight.detach())  # per output channel
        # [out, in] row-major: its .t() is the column-major [in, out] operand _scaled_mm requires
        self.register_buffer("weight_fp8", q.contiguous())
        self.static = input_range is not None
        if self.static:
            input_scale = max(float(input_range), _EPS) / FP8_MAX
            self.register_buffer("input_inverse", torch.tensor(1.0 / input_scale, dtype=torch.float32))
            scale = scale * input_scale  # folded: the input's scale column is then ones
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out] fp32
        bias = linear.bias  # kept in the layer's dtype: _scaled_mm's epilogue takes a bias of its output's
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.static:  # pointwise: fused into the kernel that made x
            q = (rows.float() * self.input_inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale = rows.new_ones((rows.shape[0], 1), dtype=torch.float32)  # on the input's device
        else:
            q, scale = quantize_rows_fp8(rows)  # per token
        y = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                             bias=self.bias, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        inputs = "per tensor (static)" if self.static else "per token"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per channel x {inputs}"


def fp8_fits(linear: torch.nn.Linear) -> bool:
    """Whether _scaled_mm takes this layer's dims."""
    return linear.in_features % FP8_ALIGN == 0 and linear.out_features % FP8_ALIGN == 0


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


def quantize_linears(module: torch.nn.Module, ranges: dict[str, torch.Tensor] | None = None,
                     kind: str = "int8") -> int:
    """Replace every torch.nn.Linear under MODULE, in place, by an Int8Linear (kind "int8"), smoothed by
    RANGES (from input_ranges over the same module) where given, or by an Fp8Linear ("fp8"; a layer whose
    dims _scaled_mm does not take stays a Linear: kept_linears names them), its input scaled statically
    by the largest of its RANGES where given (fp8 is never smoothed); returns how many."""
    if kind not in ("int8", "fp8"):
        raise ValueError(f"kind must be int8 or fp8, not {kind!r}")
    replaced = 0
    for name, parent, attribute, layer in list(_linears(module)):
        if kind == "int8":
            setattr(parent, attribute, Int8Linear(layer, (ranges or {}).get(name)))
        elif fp8_fits(layer):
            if ranges is not None and name not in ranges:
                raise ValueError(f"{name}: no calibrated input range for its static fp8 scale")
            setattr(parent, attribute, Fp8Linear(layer, None if ranges is None else float(ranges[name].max())))
        else:
            continue  # kept: _scaled_mm does not take its dims
        replaced += 1
    return replaced


def kept_linears(module: torch.nn.Module) -> list[str]:
    """The qualified names of the torch.nn.Linear layers under MODULE: after quantize_linears, those it kept."""
    return [name for name, _, _, _ in _linears(module)]
