"""The family matrix of tests/unit/test_families.py on a GPU: each family's tiny scaled-weight model, packed
(flash varlen, with each layer's window) in bf16 on CUDA against the model run alone (padded, transformers'
own masks) in fp32 on CUDA, on lengths 1..64 and past every window; and with the windows or the position
offset removed, to show the check sees them.

    PYTHONUNBUFFERED=1 python3 benchmarks/families_cuda.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench-out")
    a = p.parse_args()
    import torch

    from builder.runtime import packed as packed_module
    from builder.runtime.backends.torch_common import build_module
    from builder.runtime.packed import pack
    from builder.runtime.params import EngineParams
    from tests.unit.test_families import LENGTHS, _configs, save_scaled

    results = {}
    work = Path(tempfile.mkdtemp())
    for name, (pooling, config) in _configs().items():
        save_scaled(config, work / name)
        gen = torch.Generator().manual_seed(1)
        seqs = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in LENGTHS]
        padded = build_module(str(work / name), EngineParams(pooling=pooling, max_batch=16, max_seq_len=64),
                              torch.float32, "cuda")
        with torch.no_grad():
            want = torch.stack([padded(torch.tensor([s], device="cuda"),
                                       torch.ones(1, len(s), dtype=torch.long, device="cuda"))[0] for s in seqs])
        row = {}
        cases = (("packed", None), ("windows removed", "window_reach"), ("positions from 0", "first_position"))
        for case, patch in cases:
            saved = getattr(packed_module, patch) if patch else None
            if patch:
                setattr(packed_module, patch, (lambda w: None) if patch == "window_reach" else (lambda c: 0))
            try:
                module = build_module(str(work / name), EngineParams(pooling=pooling, max_batch=16, max_seq_len=64,
                                                                     input_form="packed", device="cuda",
                                                                     precision="bf16"), torch.bfloat16, "cuda")
                with torch.no_grad():
                    got = module(*(t.cuda() for t in pack(seqs))).float()
                row[case] = round(float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min()), 6)
            finally:
                if patch:
                    setattr(packed_module, patch, saved)
        results[name] = row
        print(name, json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "families_cuda.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                        "min_cosine_bf16_vs_fp32": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
