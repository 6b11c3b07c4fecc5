"""Attention kernels alone, at the shapes a packed or padded engine call runs them, side by side.

    PYTHONUNBUFFERED=1 python3 benchmarks/attention_probe.py --out $OUT [--family qwen3|bert] [--sweep]

Why: the packed Qwen3-0.6B engine ran 0.95x the padded one at a full 64 x 512 batch (issue 17), the
rest of the graph being the same matmuls on the same tokens. This times one layer's attention in
each form the engines could use, in milliseconds per call (median of timed rounds, CUDA events):
  padded/flash, padded/cudnn, padded/efficient   SDPA on [batch, heads, seq, dim], one backend each
  varlen/flash     aten._flash_attention_forward on the packed stream (what packed engines call)
  varlen/cudnn     aten._cudnn_attention_forward on the packed stream, where this torch has it
  varlen/triton    mopt's Triton kernel (builder/runtime/varlen_attention.py) on the packed stream;
                   with --sweep, also launched at each tile size of SWEEP (the shipped ones are its CONFIGS)
for the full batch, log-normal lengths (median 58, 8..SEQ), 16 x 128 and 1 x 32, and checks each packed form
against per-sequence SDPA (max abs error). With --switch, also exports one layer's attention that
picks cuDNN's dense kernel for a uniform batch and flash varlen otherwise (torch.cond), compiles it
with AOTInductor and times it the same way. Writes attention_probe_FAMILY.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from builder.runtime import varlen_attention

SHAPES = {"qwen3": dict(heads=16, kv_heads=8, dim=128, causal=True),
          "bert": dict(heads=12, kv_heads=12, dim=64, causal=False)}


def timed(fn, rounds=30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(sorted(times)[len(times) // 2], 4)


def lognormal(seq: int, n: int, rng) -> list[int]:
    return [max(8, min(seq, round(math.exp(rng.gauss(math.log(58), 1.0))))) for _ in range(n)]


def reference(q, k, v, lengths, causal):
    """Per-sequence SDPA in fp32, at SDPA's default scale (the runtime's reference for the Triton kernel)."""
    return varlen_attention.reference(q, k, v, lengths, causal, q.shape[-1] ** -0.5)


def case(lengths: list[int], shape: dict, dtype, sweep: bool = False) -> dict:
    h, hk, d, causal = shape["heads"], shape["kv_heads"], shape["dim"], shape["causal"]
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(total, hk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(total, hk, d, device="cuda", dtype=dtype, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    res: dict = {"sequences": b, "tokens": total, "longest": longest}
    ref = reference(q, k, v, lengths, causal)

    # padded [b, heads, longest, dim] from the stream, zero rows past each length
    def to_block(t):
        out = t.new_zeros(b, longest, t.shape[1], d)
        start = 0
        for i, n in enumerate(lengths):
            out[i, :n] = t[start:start + n]
            start += n
        return out.transpose(1, 2)
    pq, pk, pv = to_block(q), to_block(k), to_block(v)
    full = all(n == longest for n in lengths)
    mask = None
    if not full:
        valid = torch.arange(longest, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
        mask = valid[:, None, None, :]
        if causal:
            mask = mask & torch.ones(longest, longest, device="cuda", dtype=torch.bool).tril()[None, None]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(pq, pk, pv, attn_mask=mask, is_causal=causal and full,
                                                      enable_gqa=hk != h)
        try:
            res[f"padded/{name}"] = timed(run)
        except RuntimeError as exc:
            res[f"padded/{name}"] = f"unavailable: {str(exc).splitlines()[0][:120]}"

    def flash():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False)[0]
    res["varlen/flash"] = timed(flash)
    res["varlen/flash max_err"] = float((flash().float() - ref).abs().max())

    if hasattr(torch.ops.aten, "_cudnn_attention_forward"):
        kx, vx = (t.repeat_interleave(h // hk, dim=1) if hk != h else t for t in (k, v))
        cu64 = cu.long()

        def cudnn():
            # nested (ragged) layout: [tokens, heads, dim] with cumulative offsets, as torch's
            # nested-tensor path calls it
            return torch.ops.aten._cudnn_attention_forward(q, kx, vx, None, cu64, cu64, longest, longest, False,
                                                           0.0, causal, False)[0]
        try:
            out = cudnn()
            res["varlen/cudnn max_err"] = float((out.float().reshape(ref.shape) - ref).abs().max())
            res["varlen/cudnn"] = timed(cudnn)
        except (RuntimeError, TypeError) as exc:
            res["varlen/cudnn"] = f"unavailable: {str(exc).splitlines()[0][:160]}"
    else:
        res["varlen/cudnn"] = "unavailable: no aten._cudnn_attention_forward"

    # mopt's Triton kernel (builder/runtime/varlen_attention.py) through its op, with the shipped tiles
    ml = torch.empty(longest, device="cuda", dtype=torch.int8)

    def triton_op():
        return varlen_attention.op()(q, k, v, cu, ml, causal, d ** -0.5)
    res["varlen/triton"] = timed(triton_op)
    res["varlen/triton max_err"] = float((triton_op().float() - ref).abs().max())
    if sweep:
        res["varlen/triton sweep"] = sweep_tiles(q, k, v, cu, longest, causal, ref)
    return res


# (BLOCK_M, BLOCK_N, warps, stages). Eight warps and BLOCK_N 128 lost everywhere on the H100 at BLOCK_M 64
# (2026-12-07, the first sweep: 64 x 32, 4 warps, 3 stages best for Qwen3's shape); 8 warps kept for BLOCK_M 128.
SWEEP = [(m, n, w, s) for m in (32, 64, 128) for n in (16, 32, 64) if n <= m for w in (4, 8) if w == 4 or m == 128
         for s in (2, 3, 4)]


def sweep_tiles(q, k, v, cu, longest, causal, ref) -> dict:
    """The kernel launched directly with each (BLOCK_M, BLOCK_N, warps, stages): ms per call, or why not."""
    from builder.runtime.varlen_attention_kernel import varlen_attention_kernel as kernel
    out, d = torch.empty_like(q), q.shape[-1]
    found = {}
    for m, n, w, s in SWEEP:
        grid = ((longest + m - 1) // m, q.shape[1], cu.shape[0] - 1)

        def run(m=m, n=n, w=w, s=s, grid=grid):
            kernel[grid](q, k, v, out, cu, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                         v.stride(1), out.stride(0), out.stride(1), q.shape[1] // k.shape[1],
                         d ** -0.5 * 1.4426950408889634, CAUSAL=causal, HEAD_DIM=d, BLOCK_M=m, BLOCK_N=n,
                         num_warps=w, num_stages=s)
            return out
        name = SWEEP_NAMES[SWEEP.index((m, n, w, s))]
        try:
            err = float((run().float() - ref).abs().max())
            found[name] = timed(run) if err < 0.05 else f"wrong: max_err {err}"
        except Exception as exc:  # a probe: out of shared memory and the like
            found[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    timings = {name: ms for name, ms in found.items() if isinstance(ms, float)}
    found["best"] = min(timings, key=timings.get) if timings else None
    return found


class _Switch(torch.nn.Module):
    """One layer's attention as a packed engine could export it: a uniform batch takes cuDNN's dense
    kernel, any other the variable-length flash kernel; torch.cond chooses at run time. VARIANT names
    how the dense branch regains [sequences, longest] from the stream:
      view   the stream [tokens, ...] reshaped by the sequence count and the longest length (fails to
             export on torch 2.11: tokens = sequences x longest is a relation between dynamic dims)
      rows   the stream arrives as [rows, row_len, ...]: [1, tokens] mixed, [sequences, longest]
             uniform, so the dense shape is the input's own and no relation between dims is assumed.
    Both branches return [rows, row_len, heads, dim], densely strided (cond requires it)."""

    def __init__(self, variant: str, causal: bool, heads: int, kv_heads: int):
        super().__init__()
        self.variant, self.causal, self.heads, self.kv_heads = variant, causal, heads, kv_heads

    def split(self, qkv):
        return qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=-2)

    def dense(self, qkv, lengths, max_len):
        if self.variant == "view":
            q, k, v = (t.reshape(lengths.shape[0], max_len.shape[0], t.shape[1], t.shape[2])
                       for t in self.split(qkv))
        else:
            q, k, v = self.split(qkv)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)
        return out.transpose(1, 2).contiguous()

    def varlen(self, qkv, lengths, max_len):
        q, k, v = (t.flatten(0, 1) if t.dim() == 4 else t for t in self.split(qkv))
        cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len.shape[0], max_len.shape[0], 0.0,
                                                      self.causal, False)[0]
        return out.view(*qkv.shape[:-2], self.heads, out.shape[-1])

    def forward(self, qkv, lengths, max_len):
        if self.variant == "view":
            uniform = (lengths == max_len.shape[0]).all()
        else:
            uniform = qkv.shape[0] > 1
        out = torch.cond(uniform, self.dense, self.varlen, (qkv, lengths, max_len))
        return out.flatten(0, 1) if out.dim() == 4 else out


def exported_switch(shape: dict, work: Path) -> dict:
    """Whether the switch exports and compiles with AOTInductor, per variant, and what it costs."""
    from torch.export import Dim
    h, hk, d, causal = shape["heads"], shape["kv_heads"], shape["dim"], shape["causal"]
    out: dict = {}
    rng = random.Random(1)
    for variant in ("rows",):  # "view" failed to export (see _Switch)
        try:
            mod = _Switch(variant, causal, h, hk)
            tokens, seqs = Dim("tokens", min=1, max=65536), Dim("seqs", min=1, max=512)
            longest = Dim("longest", min=1, max=8192)
            lengths = torch.tensor([40, 56], device="cuda", dtype=torch.int32)
            if variant == "rows":
                rows = Dim("rows", min=1, max=512)
                qkv = torch.randn(2, 48, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
                dims = ({0: rows, 1: tokens}, {0: seqs}, {0: longest})
            else:
                qkv = torch.randn(96, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
                dims = ({0: tokens}, {0: seqs}, {0: longest})
            prog = torch.export.export(mod, (qkv, lengths, torch.empty(56, device="cuda")), dynamic_shapes=dims)
            path = torch._inductor.aoti_compile_and_package(prog, package_path=str(work / f"switch_{variant}.pt2"))
            runner = torch._inductor.aoti_load_package(path)
            res = {}
            for name, lens in (("fixed", [512] * 64), ("lognormal", lognormal(512, 64, rng))):
                total = sum(lens)
                qkv = torch.randn(total, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
                q, k, v = qkv.split([h, hk, hk], dim=1)
                if variant == "rows":
                    qkv = qkv.reshape(len(lens), lens[0], h + 2 * hk, d) if len(set(lens)) == 1 else qkv[None]
                lt = torch.tensor(lens, device="cuda", dtype=torch.int32)
                ml = torch.empty(max(lens), device="cuda")
                got = runner(qkv, lt, ml)
                res[name] = timed(lambda r=runner, x=(qkv, lt, ml): r(*x))
                res[name + " max_err"] = float((got.float() - reference(q, k, v, lens, causal)).abs().max())
            out[variant] = res
        except Exception as exc:  # a probe: record why a variant failed, try the next
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()][:6]
            out[variant] = f"failed: {type(exc).__name__}: " + " | ".join(ln[:200] for ln in lines)
    return out


def best_tiles(report: dict) -> str:
    """The sweep's tiles with the least fixed + log-normal time, as MOPT_VARLEN_TILES takes them."""
    sweeps = [report["runs"][case]["varlen/triton sweep"] for case in ("fixed", "lognormal")]
    both = [name for name in SWEEP_NAMES if all(isinstance(s.get(name), float) for s in sweeps)]
    name = min(both, key=lambda n: sum(s[n] for s in sweeps))
    m_n, w, s = name.split()
    return ",".join([*m_n.split("x"), w[1:], s[1:]])


SWEEP_NAMES = [f"{m}x{n} w{w} s{s}" for m, n, w, s in SWEEP]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--family", choices=sorted(SHAPES), default="qwen3")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--switch", action="store_true", help="also export and compile the torch.cond switch")
    p.add_argument("--work", default="/tmp/mopt-attention-probe")
    p.add_argument("--sweep", action="store_true", help="time the Triton kernel at every tile size of SWEEP")
    p.add_argument("--best", metavar="REPORT", help="print the best swept tiles of an earlier report, as "
                   "MOPT_VARLEN_TILES takes them, and exit (kernels_gpu.sh TUNED=1)")
    a = p.parse_args(argv)
    if a.best:
        print(best_tiles(json.loads(Path(a.best).read_text())))
        return 0
    shape, rng = SHAPES[a.family], random.Random(0)
    runs = {"fixed": case([a.seq] * a.batch, shape, torch.bfloat16, a.sweep),
            "lognormal": case(lognormal(a.seq, a.batch, rng), shape, torch.bfloat16, a.sweep),
            "16x128": case([128] * 16, shape, torch.bfloat16, a.sweep),
            "1x32": case([32], shape, torch.bfloat16)}
    report = {"family": a.family, "shape": shape, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(), "units": "ms per call (one layer)", "runs": runs}
    if a.switch:
        Path(a.work).mkdir(parents=True, exist_ok=True)
        report["switch"] = exported_switch(shape, Path(a.work))
    print(json.dumps(report, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"attention_probe_{a.family}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
