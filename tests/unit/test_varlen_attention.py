"""The variable-length attention kernel (builder/runtime/varlen_attention.py) against per-sequence SDPA.

As for the fused q/k kernel (test_fused_qk.py), the kernel runs in Triton's interpreter here
(TRITON_INTERPRET=1, in a fresh process: the interpreter is chosen when the kernel is defined). Triton
3.6's interpreter multiplies bf16 tiles wrongly (tl.dot on bf16 gives values of 1e10 for a plain 16 x 16
product of normal values), so bf16 is not run here; fp32 holds the arithmetic exactly and fp16 the
half-precision path (p rounded to v's dtype before the second product, as flash attention does). Its
speed and its bf16 results on the GPU, inside AOTInductor engines, are measured by
benchmarks/attention_probe.py and benchmarks/packed_bench.py (docs/performance.md)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.runtime import packed, varlen_attention
from builder.runtime.errors import UsageError

REPO = Path(__file__).resolve().parents[2]

# Lengths around the tiles' edges (BLOCK_N 64 and 32, BLOCK_M 128 and 64): a one-token sequence, one
# block less one, exactly one, one more, and a sequence of several query blocks. Heads: grouped-query
# (2 and 4 q heads a k/v head) and plain; v read as a column slice of a wider tensor (a merged
# projection's output), so token and head strides are not the dense ones.
PROBE = r"""
import json, torch
from builder.runtime import packed, varlen_attention as va

torch.manual_seed(0)
cases = []
for dtype in (torch.float32, torch.float16):
    for heads, kv_heads, dim, causal, lengths in (
            (4, 2, 16, True, [1, 63, 64, 65, 129]), (4, 4, 32, False, [127, 3, 128]),
            (4, 1, 64, True, [300, 17]), (2, 1, 128, False, [65, 129, 1]), (2, 2, 256, True, [70, 33])):
        tokens = sum(lengths)
        q = torch.randn(tokens, heads, dim, dtype=dtype)
        k = torch.randn(tokens, kv_heads, dim, dtype=dtype) * 2
        wide = torch.randn(tokens, 3 * kv_heads * dim, dtype=dtype)
        v = wide[:, kv_heads * dim:2 * kv_heads * dim].view(tokens, kv_heads, dim)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        max_len = torch.zeros(max(lengths), dtype=torch.int8)
        scale = dim ** -0.5
        out = va.op()(q, k, v, cu, max_len, causal, scale)
        ref = va.reference(q, k, v, lengths, causal, scale)
        dispatched = out  # fp32 is not the kernel's (fits): packed engines in fp32 gather attention instead
        if dtype == torch.float16:
            dispatched = packed._flash_attention(q, k, v, torch.zeros(1, tokens), cu, max_len, causal=causal,
                                                 scaling=None).view(out.shape)
        cases.append({"dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "dim": dim, "causal": causal,
                      "lengths": lengths, "shape": list(out.shape), "dtype_out": str(out.dtype),
                      "max_err": (out.float() - ref).abs().max().item(),
                      "dispatched_equal": torch.equal(dispatched, out),
                      "bidirectional_err": (out.float() - va.reference(q, k, v, lengths, not causal, scale))
                      .abs().max().item()})
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def probe():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), MOPT_VARLEN_KERNEL="triton")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_the_kernel_computes_per_sequence_attention(probe):
    assert len(probe) == 2 * 5
    assert {case["dim"] for case in probe} == set(varlen_attention.CONFIGS)
    for case in probe:
        assert case["shape"] == [sum(case["lengths"]), case["heads"], case["dim"]], case
        assert case["dtype_out"] == case["dtype"], case
        # fp32: summation order only. fp16: p is rounded to fp16 before it weighs v (flash attention's
        # rounding), and the output once; values of v are N(0, 1), outputs below 4 in size.
        assert case["max_err"] <= (1e-5 if case["dtype"] == "torch.float32" else 4e-3), case
        # the mask matters: the other direction's attention is far off (a leaked future key shows)
        assert case["bidirectional_err"] > 0.1, case


@pytest.mark.timeout(300)
def test_packed_attention_takes_the_kernel_when_asked(probe):
    for case in probe:
        assert case["dispatched_equal"], case


@pytest.mark.timeout(30)
def test_the_kernel_is_not_used_where_it_does_not_fit():
    half = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert varlen_attention.fits(half, None)
    assert not varlen_attention.fits(half, 127)  # a sliding window: aten's kernel takes it
    assert not varlen_attention.fits(half.float(), None)  # fp32: gathered SDPA serves those engines
    assert not varlen_attention.fits(torch.zeros(4, 2, 96, dtype=torch.bfloat16), None)  # no tiles for 96
    assert all(n <= m and m % n == 0 for m, n, _, _ in varlen_attention.CONFIGS.values())


@pytest.mark.timeout(30)
def test_the_kernel_choice_is_validated_and_recorded(monkeypatch):
    monkeypatch.setenv(varlen_attention.ENV, "triton")
    assert packed.attention_plan("cuda", "bf16", dense=False)["mixed"].startswith("triton varlen")
    assert packed.attention_plan("cpu", "fp32", dense=False)["mixed"] == "gathered sdpa (masked block)"
    monkeypatch.setenv(varlen_attention.ENV, "flash")
    assert packed.attention_plan("cuda", "fp8", dense=False)["mixed"] == "flash varlen"
    monkeypatch.setenv(varlen_attention.ENV, "cudnn")
    with pytest.raises(UsageError, match="MOPT_VARLEN_KERNEL"):
        varlen_attention.kernel_name()


@pytest.mark.timeout(30)
def test_tiles_come_from_the_table_or_a_valid_override(monkeypatch):
    monkeypatch.delenv(varlen_attention.TILES_ENV, raising=False)
    assert varlen_attention.tiles(128) == varlen_attention.CONFIGS[128]
    monkeypatch.setenv(varlen_attention.TILES_ENV, "64,32,4,2")
    assert varlen_attention.tiles(128) == varlen_attention.tiles(32) == (64, 32, 4, 2)
    for bad in ("64,128,4,2", "96,32,4,2", "128,64,8", "a,b,c,d", "128,64,3,3", "128,64,8,0"):
        monkeypatch.setenv(varlen_attention.TILES_ENV, bad)
        with pytest.raises(UsageError, match="MOPT_VARLEN_TILES"):
            varlen_attention.tiles(128)
    monkeypatch.setenv(varlen_attention.ENV, "triton")
    with pytest.raises(UsageError, match="MOPT_VARLEN_TILES"):  # checked with the kernel's choice
        varlen_attention.kernel_name()


# The kernel compiled for sm_90 as AOTInductor compiles it inside an engine: Inductor types a Python float
# argument as fp64 (torch/_inductor/codegen/triton_utils.py, signature_of), where a direct launch passes
# fp32. Uncast, that scale widened the scores and the accumulator to fp64 and tl.dot refused them: the first
# H100 engine with the kernel failed to compile (2026-12-07). Triton's compiler and its ptxas run without a
# GPU; the PTX shows whether the products take Hopper's warpgroup instructions (wgmma), the reason for the
# kernel. A fresh process: the interpreter of the tests above must not be on.
COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from builder.runtime.varlen_attention import CONFIGS
from builder.runtime.varlen_attention_kernel import varlen_attention_kernel as kernel

out = []
cases = [("fp64", dim % 32 == 0, dim) for dim in sorted(CONFIGS)] + [("fp32", True, 128)]  # every tile shipped
for scale_type, causal, dim in cases:
    signature = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    signature["cu_seqlens"] = "*i32"
    for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                 "stride_oh", "group"):
        signature[name] = "i32"
    signature["qk_scale"] = scale_type
    block_m, block_n, warps, stages = CONFIGS[dim]
    constants = {"CAUSAL": causal, "HEAD_DIM": dim, "BLOCK_M": block_m, "BLOCK_N": block_n}
    signature.update({name: "constexpr" for name in constants})
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    out.append({"scale": scale_type, "causal": causal, "dim": dim, "cubin_bytes": len(compiled.asm["cubin"]),
                "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")})
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_the_kernel_compiles_for_hopper_as_aotinductor_types_its_scale():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE], cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [case["dim"] for case in compiled] == [16, 32, 64, 128, 256, 128]
    for case in compiled:
        assert case["cubin_bytes"] > 10_000, case
        assert case["wgmma"] > 0, case  # both products on Hopper's matrix instructions
