"""Where an engine's start goes, step by step, in this fresh process (the serve path of the images):

    python3 benchmarks/start_breakdown.py ENGINE_DIR        # e.g. an engine gpu_bench.py compiled

Steps: import torch; the guard (every engine file's sha256, with the host facts: CUDA initialised);
the backend's load (torch-inductor: graph tensors to the device + the Inductor artifact); the
first calls on three shapes. Prints one JSON line of cumulative and per-step seconds.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T0 = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    steps: dict[str, float] = {}
    last = [T0]

    def mark(name: str) -> None:
        now = time.monotonic()
        steps[name] = round(now - last[0], 3)
        last[0] = now

    import torch
    mark("import torch")
    from builder.runtime import guard
    from builder.runtime.backends import get_backend
    from builder.runtime.params import EngineParams
    engine_dir, data = guard.resolve(sys.argv[1])
    mark("guard (hashes + host facts)")
    params = EngineParams.from_dict(data["params"])
    run = get_backend(data["backend"]).load(Path(engine_dir) / "engine", params)
    mark("backend load")
    for b, s in ((2, 8), (params.max_batch, params.max_seq_len), (3, 40)):
        ids = torch.ones(b, s, dtype=torch.long)
        run(ids, ids)
        mark(f"call {b}x{s}")
    print(json.dumps({"engine_dir": str(engine_dir), "backend": data["backend"], "steps_s": steps,
                      "total_s": round(time.monotonic() - T0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
