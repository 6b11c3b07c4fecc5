"""Scratch (not committed): packed engine with torch.cond on CUDA, exact or not, operands as-is vs contiguous."""
import sys, json, random
import torch
sys.path.insert(0, ".")
from builder.runtime import packed
from builder.runtime.backends.torch_common import build_module, export_graph, tuned_example
from builder.runtime.params import EngineParams
from builder.runtime.tiny_qwen3 import make_tiny_qwen3
from builder.runtime.packed import pack

orig = packed._pack_attention
def contiguous_attention(module, query, key, value, *a, **kw):
    return orig(module, query.transpose(1, 2).contiguous().transpose(1, 2), key.transpose(1, 2).contiguous().transpose(1, 2),
                value.transpose(1, 2).contiguous().transpose(1, 2), *a, **kw)
model = make_tiny_qwen3("/tmp/tq")
res = {}
CONFIGS = {"noreuse": {"allow_buffer_reuse": False}, "noreuse_noinplace": {"allow_buffer_reuse": False, "inplace_buffers": False},
           "nofuse": {"max_fusion_size": 1}}
for variant in sys.argv[1].split(","):
    if variant == "contiguous":
        from transformers import AttentionInterface
        AttentionInterface.register(packed.ATTN_IMPLEMENTATION, contiguous_attention)
        packed.register = lambda: packed.ATTN_IMPLEMENTATION
    params = EngineParams(pooling="last", max_batch=8, max_seq_len=64, input_form="packed", device="cuda",
                          precision="bf16", backend="torch-aot")
    m = build_module(str(model), params, torch.bfloat16, "cuda")
    with torch.no_grad():
        ex, _ = export_graph(m, tuned_example(params, "cuda", False), params)
        path = torch._inductor.aoti_compile_and_package(ex, package_path=f"/tmp/{variant}.pt2",
                                                        inductor_configs=CONFIGS.get(variant, {}) | {"triton.autotune_at_compile_time": False})
    run = torch._inductor.aoti_load_package(path)
    rng = random.Random(0)
    out = {}
    for name, lens in (("uniform", [16] * 4), ("mixed", [5, 17, 1, 40, 33]), ("one", [7])):
        seqs = [[rng.randrange(3, 100) for _ in range(n)] for n in lens]
        inp = tuple(t.cuda() for t in pack(seqs))
        with torch.no_grad():
            want = m(*inp).float()
            got = run(*inp).float()
            graph = ex.module()(*inp).float()
        out[name] = round(torch.nn.functional.cosine_similarity(got, want).min().item(), 5)
        out[name + "/exported"] = round(torch.nn.functional.cosine_similarity(graph, want).min().item(), 5)
    res[variant] = out
    print(variant, out, flush=True)
print(json.dumps(res))
