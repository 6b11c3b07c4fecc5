"""The fused q/k RMSNorm + rotary kernel (builder/runtime/fused_qk.py) against the unfused form.

The kernel is Triton's: on these CPU-only machines it runs in Triton's interpreter (TRITON_INTERPRET=1,
the same kernel source executed with numpy), in a fresh process because the interpreter is chosen when
the kernel is defined. What only the GPU shows, its speed and its compiled form inside an AOTInductor
engine, is measured by benchmarks/packed_bench.py on the GPU machine (docs/performance.md)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.runtime import fused_qk, merged

REPO = Path(__file__).resolve().parents[2]

# Runs in the interpreter: the op on random q/k (fp32, bf16 and fp16; head counts that are and are not
# powers of two, more kv heads than q heads; head_dim 16 to 128; rotary tables whose halves differ, as
# non-default rotary types may give, and a sin table with strided rows), and a tiny Qwen3 packed module
# with and without the fused forward.
PROBE = r"""
import json, sys, torch
from builder.runtime import fused_qk
from builder.runtime.merged import merge_projections
from builder.runtime.backends.torch_common import build_module
from builder.runtime.packed import pack
from builder.runtime.params import EngineParams
from builder.runtime.tiny_qwen3 import make_tiny_qwen3

torch.manual_seed(0)
out = {"op": []}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for heads, kv_heads, dim, tables in ((4, 2, 16, "default"), (6, 3, 32, "halves differ"), (2, 5, 64, "strided"),
                                         (16, 8, 128, "default")):
        tokens = 29
        q = torch.randn(tokens, heads, dim, dtype=dtype) * 3
        k = torch.randn(tokens, kv_heads, dim, dtype=dtype)
        qw, kw = torch.randn(dim, dtype=dtype), torch.randn(dim, dtype=dtype)
        angles = torch.arange(tokens).float()[:, None] * torch.rand(dim // 2)
        emb = torch.cat([angles, angles], -1) if tables != "halves differ" else \
            torch.arange(tokens).float()[:, None] * torch.rand(dim)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if tables == "strided":
            sin = torch.cat([sin, torch.zeros_like(sin)], -1)[:, :dim]  # rows 2 * dim apart
        fused = fused_qk.op()(q, k, qw, kw, cos, sin, 1e-6)
        # q and k as column slices of one wider output (merged.py's qkv_proj): read in place, not copied
        wide = torch.cat([q.flatten(1), k.flatten(1), torch.full((tokens, dim), float("nan"), dtype=dtype)], 1)
        q_view, k_view, _ = wide.split([heads * dim, kv_heads * dim, dim], 1)
        sliced = fused_qk.op()(q_view.view(tokens, heads, dim), k_view.view(tokens, kv_heads, dim), qw, kw,
                               cos, sin, 1e-6)
        out["sliced_equal"] = out.get("sliced_equal", True) and all(torch.equal(a, b) for a, b in zip(fused, sliced))
        eager = fused_qk.reference(q, k, qw, kw, cos, sin, 1e-6)
        once = fused_qk.reference(q.float(), k.float(), qw.float(), kw.float(), cos.float(), sin.float(), 1e-6,
                                  norm_dtype=dtype)
        for name, a, b, c in zip("qk", fused, eager, once):
            out["op"].append({"dtype": str(dtype), "tensor": name, "dim": dim, "tables": tables,
                              "shape": list(a.shape), "ref_shape": list(b.shape),
                              "dtype_out": str(a.dtype), "vs_eager": (a.float() - b.float()).abs().max().item(),
                              "vs_rounded_once": (a.float() - c.to(dtype).float()).abs().max().item(),
                              "scale": b.float().abs().max().item()})
model = make_tiny_qwen3(sys.argv[1])
params = EngineParams(backend="torch-aot", device="cpu", precision="fp32", pooling="last", max_batch=8,
                      max_seq_len=64, input_form="packed")
plain = build_module(str(model), params, torch.float32, "cpu")
fused = build_module(str(model), params, torch.float32, "cpu")
out["layers"] = fused_qk.fuse_qk_norm_rope(fused.body)
merged = build_module(str(model), params, torch.float32, "cpu")
fused_qk.fuse_qk_norm_rope(merged.body)
out["merged"] = merge_projections(merged.body)
inputs = pack([[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]])
with torch.no_grad():
    a, b, c = plain(*inputs), fused(*inputs), merged(*inputs)
out["module_max_diff"] = (a - b).abs().max().item()
out["module_cosine_min"] = torch.nn.functional.cosine_similarity(a, b).min().item()
out["merged_max_diff"] = (a - c).abs().max().item()
out["shape"] = list(b.shape)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path_factory.mktemp("tiny-qwen3"))], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_the_kernel_matches_the_unfused_norm_and_rotation(probe):
    assert len(probe["op"]) == 3 * 4 * 2
    assert {case["tables"] for case in probe["op"]} == {"default", "halves differ", "strided"}
    for case in probe["op"]:
        assert case["shape"] == case["ref_shape"] and case["dtype_out"] == case["dtype"], case
        if case["dtype"] == "torch.float32":
            assert case["vs_eager"] <= 2e-6 * case["scale"], case
        else:
            # bf16 and fp16: the kernel rotates in fp32 and rounds once, where eager rounds after each
            # operation; and its fp32 1/sqrt can round the normalised value to the neighbouring step,
            # which the weight then scales. A step: 2^-7 (bf16) or 2^-10 (fp16) of the largest value's power of two.
            step = 2.0 ** (math.floor(math.log2(case["scale"])) - (7 if case["dtype"] == "torch.bfloat16" else 10))
            # (Measured: up to 3 bf16 steps against either, 1 fp16 step. A wrong sign, half or weight is off
            # by the value's own size, a hundred steps; fp32 above holds the arithmetic to 2e-6.)
            assert case["vs_rounded_once"] <= 4 * step, case
            assert case["vs_eager"] <= 6 * step, case
            assert case["vs_eager"] > 0  # half precision really ran (fp32 would be exact)


@pytest.mark.timeout(300)
def test_a_fused_packed_qwen3_module_computes_what_the_unfused_one_does(probe):
    assert probe["layers"] == 2  # every attention layer of the tiny Qwen3 took the fused forward
    assert probe["shape"] == [3, 64]
    assert probe["module_max_diff"] < 1e-5 and probe["module_cosine_min"] > 0.999999


@pytest.mark.timeout(300)
def test_q_and_k_sliced_from_a_merged_projection_give_what_contiguous_ones_do(probe):
    assert probe["sliced_equal"] is True  # bit for bit: the kernel reads the slices in place


@pytest.mark.timeout(300)
def test_a_fused_and_merged_packed_qwen3_module_computes_what_the_plain_one_does(probe):
    assert probe["merged"] == {"qkv": 2, "gate_up": 2}
    assert probe["merged_max_diff"] < 1e-5


@pytest.mark.timeout(60)
def test_only_qwen3_attention_layers_with_a_power_of_two_head_dim_are_fused():
    from transformers import BertConfig, BertModel, Qwen3Config, Qwen3Model

    qwen = Qwen3Model(Qwen3Config(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert fused_qk.fuse_qk_norm_rope(qwen) == 3
    assert all(layer.self_attn.forward.__func__ is fused_qk._fused_forward for layer in qwen.layers)
    odd = Qwen3Model(Qwen3Config(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12))
    assert fused_qk.fuse_qk_norm_rope(odd) == 0
    bert = BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32))
    assert fused_qk.fuse_qk_norm_rope(bert) == 0


@pytest.mark.timeout(60)
def test_the_reference_is_transformers_qwen3_norm_and_rotation():
    """reference() is what the kernel is held to: it must be transformers' own arithmetic."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 7, 4, 2, 16
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(tokens, heads, dim, dtype=dtype), torch.randn(tokens, kv_heads, dim, dtype=dtype)
        qn, kn = Qwen3RMSNorm(dim, eps=1e-6).to(dtype), Qwen3RMSNorm(dim, eps=1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(dim))
            kn.weight.copy_(torch.randn(dim))
        angles = torch.arange(tokens).float()[:, None] * torch.rand(dim // 2)
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        theirs = apply_rotary_pos_emb(qn(q)[None].transpose(1, 2), kn(k)[None].transpose(1, 2), cos[None], sin[None])
        ours = fused_qk.reference(q, k, qn.weight, kn.weight, cos, sin, 1e-6)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b[0].transpose(0, 1)), dtype


@pytest.mark.timeout(60)
def test_the_fused_op_can_be_turned_off_for_measurement(monkeypatch):
    monkeypatch.delenv(fused_qk.ENV, raising=False)
    assert fused_qk.wanted()
    monkeypatch.setenv(fused_qk.ENV, "0")
    assert not fused_qk.wanted()


@pytest.mark.timeout(120)
def test_the_exported_packed_graph_keeps_the_op_once_per_layer(tmp_path):
    """torch.export keeps the triton_op as one node per layer (AOTInductor compiles its kernel from there)."""
    from builder.runtime.backends.torch_common import build_module, export_graph, tuned_example
    from builder.runtime.params import EngineParams
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    params = EngineParams(backend="torch-aot", device="cpu", precision="fp32", pooling="last", max_batch=8,
                          max_seq_len=64, input_form="packed")
    module = build_module(str(make_tiny_qwen3(tmp_path / "tiny")), params, torch.float32, "cpu")
    assert fused_qk.fuse_qk_norm_rope(module.body) == 2
    exported, _ = export_graph(module, tuned_example(params, "cpu", pad_left=params.pad_left), params)
    ops = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert ops.count(fused_qk.OP.replace("::", ".") + ".default") == 2
    # The q/k norms are in the kernel: what rsqrt is left is each layer's two RMSNorms and the final one
    assert sum("rsqrt" in op for op in ops) == 2 * 2 + 1


@pytest.mark.timeout(30)
def test_fp8_engines_plan_calls_and_graphs_as_flash_attention_engines():
    """fp8 engines run a bf16 body: one stream with flash varlen on CUDA, like bf16's (their traffic is not
    cut into gathered calls, and their small calls may replay from CUDA graphs)."""
    from builder.runtime.packed import attention_plan, gathers_attention

    for precision in ("bf16", "fp16", "fp8"):
        assert not gathers_attention("cuda", precision)
        assert attention_plan("cuda", precision, dense=False) == {"mixed": "flash varlen", "uniform": "flash varlen"}
    assert gathers_attention("cuda", "fp32") and gathers_attention("cpu", "bf16") and gathers_attention("cpu", "int8")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device, form, precision, fused", [
    ("cuda", "packed", "bf16", 2), ("cuda", "packed", "fp8", 2), ("cuda", "padded", "bf16", 0),
    ("cpu", "packed", "fp32", 0), ("cpu", "packed", "int8", 0)])
def test_the_compile_step_fuses_and_quantizes_what_its_params_ask_and_records_it(tmp_path, monkeypatch, device,
                                                                                    form, precision, fused):
    """torch_aot.prepare_body, as compile() calls it, on a tiny Qwen3 built on the CPU (only params.device says
    cuda): the fused forward only for packed CUDA engines, fp8 / int8 layers for their precisions, and the
    engine.json record of both."""
    from builder.runtime.backends import torch_aot
    from builder.runtime.backends.torch_common import build_module
    from builder.runtime.params import EngineParams
    from builder.runtime.quantize import Fp8Linear, Int8Linear
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    monkeypatch.delenv(fused_qk.ENV, raising=False)
    monkeypatch.delenv("MOPT_FP8_SCALES", raising=False)
    monkeypatch.delenv(merged.ENV, raising=False)  # the default: merged
    params = EngineParams(backend="torch-aot", device=device, precision=precision, pooling="last", max_batch=8,
                          max_seq_len=64, input_form=form, **({"attention": "causal"} if form == "padded" else {}))
    module = build_module(str(make_tiny_qwen3(tmp_path / "tiny")), params,
                          torch_aot.BODY_DTYPES.get(precision, torch.float32), "cpu")
    record = torch_aot.prepare_body(module, params, lambda: {})
    attention = [layer.self_attn for layer in module.body.layers]
    assert sum(a.forward.__func__ is fused_qk._fused_forward for a in attention if hasattr(a.forward, "__func__")) \
        == fused
    assert record.get("fused") == ({"qk_norm_rope": fused} if fused else None)
    packed_cuda = device == "cuda" and form == "packed"
    assert record.get("merged") == ({"qkv": 2, "gate_up": 2} if packed_cuda else None)
    # merged.py: q/k/v as one layer where the fused forward splits it, gate/up as one in every MLP
    projections = ("qkv_proj", "o_proj") if packed_cuda else ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(hasattr(a, "q_proj") != packed_cuda for a in attention)
    mlp = ("gate_up_proj", "down_proj") if packed_cuda else ("gate_proj", "up_proj", "down_proj")
    linears = {type(getattr(layer, name)) for layer in attention for name in projections} | \
        {type(getattr(layer.mlp, name)) for layer in module.body.layers for name in mlp}
    if precision == "fp8":
        assert linears == {Fp8Linear} and module.body.dtype == torch.bfloat16
        # per layer: qkv, o, gate_up, down (merged before quantizing: each input quantized once)
        assert record["fp8"]["linear_layers"] == 2 * 4 and record["fp8"]["kept_linear"] == []
    elif precision == "int8":
        assert linears == {Int8Linear} and record["int8"]["linear_layers"] == 2 * 7
    else:
        assert linears == {torch.nn.Linear} and "fp8" not in record and "int8" not in record
    monkeypatch.setenv(fused_qk.ENV, "0")  # the switches for side-by-side measurement
    again = build_module(str(tmp_path / "tiny"), params, torch_aot.BODY_DTYPES.get(precision, torch.float32), "cpu")
    record = torch_aot.prepare_body(again, params, lambda: {})
    assert "fused" not in record  # and without the fused forward, attention stays unmerged
    assert record.get("merged") == ({"qkv": 0, "gate_up": 2} if packed_cuda else None)
    monkeypatch.setenv(merged.ENV, "0")  # switched off: not merged
    again = build_module(str(tmp_path / "tiny"), params, torch_aot.BODY_DTYPES.get(precision, torch.float32), "cpu")
    assert "merged" not in torch_aot.prepare_body(again, params, lambda: {})


@pytest.mark.timeout(120)
def test_static_fp8_scales_come_from_the_calibration_pass_after_merging(tmp_path, monkeypatch):
    """MOPT_FP8_SCALES=static: prepare_body calls its calibration once, after the merge (the merged layers'
    names), each fp8 layer scaled by its range's largest value, and engine.json says so."""
    from builder.runtime.backends import torch_aot
    from builder.runtime.backends.torch_common import build_module
    from builder.runtime.params import EngineParams
    from builder.runtime.quantize import _linears
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    monkeypatch.delenv(fused_qk.ENV, raising=False)
    monkeypatch.setenv(merged.ENV, "1")
    monkeypatch.setenv("MOPT_FP8_SCALES", "static")
    params = EngineParams(backend="torch-aot", device="cuda", precision="fp8", pooling="last", max_batch=8,
                          max_seq_len=64, input_form="packed")
    module = build_module(str(make_tiny_qwen3(tmp_path / "tiny")), params, torch.bfloat16, "cpu")
    calls = []

    def calibration():
        names = [name for name, _, _, _ in _linears(module.body)]
        calls.append(names)
        return {name: torch.full((layer.in_features,), 2.0 + i) for i, (name, _, _, layer)
                in enumerate(_linears(module.body))}
    record = torch_aot.prepare_body(module, params, calibration)
    assert len(calls) == 1 and any(n.endswith("qkv_proj") for n in calls[0])
    assert not any(n.endswith(".q_proj") or n.endswith("gate_proj") for n in calls[0])
    assert record["fp8"]["scales"] == "per-channel weights, per-tensor static activations"
    assert record["fp8"]["linear_layers"] == 2 * 4 and record["fp8"]["calibration_texts"] >= 8
    first = module.body.layers[0].self_attn.qkv_proj
    assert first.static and float(first.input_inverse) == pytest.approx(448 / (2.0 + calls[0].index(
        "layers.0.self_attn.qkv_proj")))
    monkeypatch.setenv("MOPT_FP8_SCALES", "dynamic")
    again = build_module(str(tmp_path / "tiny"), params, torch.bfloat16, "cpu")
    record = torch_aot.prepare_body(again, params, lambda: pytest.fail("dynamic scales need no calibration"))
    assert record["fp8"]["scales"] == "per-channel weights, per-token activations"
    assert not again.body.layers[0].self_attn.qkv_proj.static
