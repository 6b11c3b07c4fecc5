"""Where an engine's start goes, step by step, in this fresh process (the serve path of the images):

    python3 benchmarks/start_breakdown.py ENGINE_DIR [--profile-load]   # e.g. an engine gpu_bench.py compiled

Steps: import torch; the guard (every engine file's sha256, the host facts: CUDA initialised, and the
backend's imports, overlapped);
the backend's load (torch-aot: torch's C++ package loader; torch-inductor: graph tensors to the
device + the Inductor artifact); the first calls on three shapes. Prints one JSON line of per-step
seconds; --profile-load adds the top functions (cumulative time) of a cProfile of the backend load.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T0 = time.monotonic()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _top(profile, n: int) -> list[str]:
    """The n functions with the most cumulative time, one line each."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("cumulative").print_stats(n)
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
    return lines[start:start + n + 1]


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
    mark("guard (hashes, host facts, backend imports)")
    params = EngineParams.from_dict(data["params"])
    backend = get_backend(data["backend"])
    profile = None
    if "--profile-load" in sys.argv:
        import cProfile
        profile = cProfile.Profile()
        run = profile.runcall(backend.load, Path(engine_dir) / "engine", params)
    else:
        run = backend.load(Path(engine_dir) / "engine", params)
    mark("backend load")
    for b, s in ((2, 8), (params.max_batch, params.max_seq_len), (3, 40)):
        ids = torch.ones(b, s, dtype=torch.long)
        run(ids, ids)
        mark(f"call {b}x{s}")
    result = {"engine_dir": str(engine_dir), "backend": data["backend"], "steps_s": steps,
              "guard_parts_s": dict(guard.LAST_CHECK_SECONDS),
              "total_s": round(time.monotonic() - T0, 3)}
    if profile is not None:
        result["load_profile"] = _top(profile, 35)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
