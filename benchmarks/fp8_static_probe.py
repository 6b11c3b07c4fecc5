"""Why static fp8 scales lose more accuracy on the GPU than on the CPU: one model, the compile gate's texts,
each fp8 form (dynamic per-token input scales, static calibrated ones) run eagerly on CUDA and on the CPU
and, on CUDA, through torch.compile (Inductor, which fuses the input's quantization into the kernel
before), against the gate's fp32 reference. Also each static layer's share of saturated inputs on the
gate's texts.

    CXX=g++ PYTHONPATH=$PWD python3 benchmarks/fp8_static_probe.py --model .carry/minilm-fp16 --out $OUT

Measured results: benchmarks/results/fp8_static_probe_h100.json, the torch.compile variants of the static
form (VARIANTS: Inductor's emulate_precision_casts, a division instead of the multiply, a graph break before
the quantization) in fp8_static_probe_h100_variants.json, and docs/performance.md (issue 37).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from builder.runtime.backends.torch_aot import calibrate  # noqa: E402
from builder.runtime.backends.torch_common import build_module, eager_reference  # noqa: E402
from builder.runtime.gate import gate_texts, model_windows  # noqa: E402
from builder.runtime.packed import pack  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.quantize import FP8_MAX, Fp8Linear, quantize_linears  # noqa: E402
from builder.runtime.tokenization import TextEncoder  # noqa: E402


def cosines(module, ids, device, want) -> dict:
    with torch.no_grad():
        got = torch.cat([module(*(t.to(device) for t in pack([s]))).float().cpu() for s in ids])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    worst = int(cos.argmin())
    return {"min": round(float(cos.min()), 6), "mean": round(float(cos.mean()), 6), "worst_tokens": len(ids[worst])}


def saturation(module, ids, device) -> dict:
    """Per static layer: the share of its inputs past the calibrated range on the gate's texts."""
    seen: dict[str, list[int]] = {}

    def hook(name):
        def record(layer, inputs, _out):
            x = inputs[0].float().abs()
            limit = FP8_MAX / float(layer.input_inverse)
            counts = seen.setdefault(name, [0, 0])
            counts[0] += int((x > limit).sum())
            counts[1] += x.numel()
        return record
    hooks = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if isinstance(m, Fp8Linear)]
    with torch.no_grad():
        for s in ids:
            module(*(t.to(device) for t in pack([s])))
    for h in hooks:
        h.remove()
    return {n: round(c[0] / c[1], 6) for n, c in seen.items() if c[0]}


def _divide_forward(self, x):
    """Fp8Linear's static forward with the input divided by its scale (as the dynamic form does) rather than
    multiplied by the scale's inverse."""
    rows = x.reshape(-1, self.in_features)
    q = (rows.float() / (1.0 / self.input_inverse)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=rows.device)
    y = torch._scaled_mm(q, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale, bias=self.bias,
                         out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], self.out_features)


def _unfused_forward(self, x):
    """The static forward with a graph break before the quantization: not fused into the kernel before."""
    torch._dynamo.graph_break()
    return _ORIGINAL_FORWARD(self, x)


_ORIGINAL_FORWARD = Fp8Linear.forward
# torch.compile variants of the static form on CUDA: name -> (Inductor config patch, Fp8Linear.forward)
VARIANTS = {"emulate_precision_casts": ({"emulate_precision_casts": True}, None),
            "divide": ({}, _divide_forward), "graph_break": ({}, _unfused_forward)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", default="probe-out")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--devices", default="cuda,cpu")
    a = p.parse_args()
    # the body is built in bf16 and its layers made fp8 here, whatever PARAMS say (they take fp8 on CUDA only)
    params = EngineParams(device="cpu", precision="fp32", max_batch=64, max_seq_len=a.max_seq_len,
                          input_form="packed", pooling="mean", normalize=True)
    enc = TextEncoder(a.model, params.pooling, params.instruction)
    texts = gate_texts(enc, a.max_seq_len, model_windows(a.model))
    ids = [s[:a.max_seq_len] for s in enc.encode(texts)]
    want = torch.tensor(eager_reference(a.model, texts, params))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"model": a.model, "texts": len(texts), "torch": torch.__version__, "gpu": gpu, "results": {}}
    for scales in ("dynamic", "static"):
        for device in a.devices.split(","):
            module = build_module(a.model, replace(params, device=device), torch.bfloat16, device)
            ranges = calibrate(module, a.model, replace(params, device=device)) if scales == "static" else None
            quantize_linears(module.body, ranges, kind="fp8")
            key = f"{scales} eager {device}"
            report["results"][key] = cosines(module, ids, device, want)
            print(key, report["results"][key], flush=True)
            if scales == "static" and device == "cuda":
                report["saturated_share"] = saturation(module, ids, device)
                for name, (config, forward) in VARIANTS.items():
                    torch._dynamo.reset()
                    Fp8Linear.forward = forward or _ORIGINAL_FORWARD
                    with torch._inductor.config.patch(config):
                        key = f"static torch.compile cuda, {name}"
                        report["results"][key] = cosines(torch.compile(module, dynamic=True), ids, device, want)
                    Fp8Linear.forward = _ORIGINAL_FORWARD
                    print(key, report["results"][key], flush=True)
                torch._dynamo.reset()
            # compiled on each device: Inductor's C++ on the CPU, its Triton kernels on CUDA
            t = time.monotonic()
            compiled = torch.compile(module, dynamic=True)
            key = f"{scales} torch.compile {device}"
            report["results"][key] = {**cosines(compiled, ids, device, want),
                                      "seconds": round(time.monotonic() - t, 1)}
            print(key, report["results"][key], flush=True)
            torch._dynamo.reset()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "fp8_static_probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
