"""What mopt's host-side GPU logic says on a real GPU host, and what the CUDA forward-compatibility
re-exec costs at start.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_host_probe.py --out $OUT [--rounds 3]

Why: doctor's brand detection (NVML, else the GPU's name), its CUDA-versions check and `pick` were
tested here with a stand-in nvidia-smi only, and the start-up re-exec (builder/runtime/cudacompat.py)
with a stand-in driver file. This runs them against the host's real driver and GPU:
  host        the driver version from /proc/driver/nvidia/version (or why it is missing), the GPUs as
              query_gpus() sees them (NVML brand included), the brand resolved by --gpu-brand auto,
              the cuda-versions check, and the tag `pick` chooses for each image in matrix.yaml;
  reexec      a child process that starts as `serve`/`check` do (reexec_if_needed first), then loads
              CUDA through torch and runs a matmul, once with MOPT_CUDA_MIN_DRIVER below the host's
              driver (no re-exec expected) and once above it (re-exec expected), with a compat dir of
              copies of the host's own libcuda (no real cuda-compat package here, and the driver is
              not older than the toolkit, so this checks the mechanism, not forward compatibility).
              Reports which libcuda the child mapped, the marker, and wall seconds (median of rounds).
Writes gpu_host_probe.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, sys, time
start = float(os.environ["PROBE_T0"])
from builder.runtime import cudacompat
if os.environ.get("PROBE_DRIVER_FILE"):
    cudacompat.PROC_DRIVER_VERSION = os.environ["PROBE_DRIVER_FILE"]
cudacompat.reexec_if_needed()
import torch
x = torch.ones(2048, 2048, device="cuda")
total = float((x @ x).sum().item())
maps = open("/proc/self/maps").read().splitlines()
libcuda = sorted({line.split()[-1] for line in maps if "libcuda.so" in line})
print(json.dumps({"applied": os.environ.get("MOPT_CUDA_COMPAT_APPLIED"), "libcuda": libcuda,
                  "ld_library_path": os.environ.get("LD_LIBRARY_PATH"), "matmul_sum": total,
                  "seconds_to_first_matmul": time.time() - start}))
"""


def host_section() -> dict:
    from builder import compat
    from builder.doctor import HostFacts, cuda_paths_check, pick, query_gpus, resolve_gpu_brand, target_gpus
    from builder.matrix import load_matrix
    from builder.plan import make_plan
    from builder.runtime import cudacompat

    proc = Path("/proc/driver/nvidia/version")
    driver, gpus, how = query_gpus()
    targets, mixed = target_gpus(gpus)
    brand, brand_how = resolve_gpu_brand("auto", targets or gpus)
    check = cuda_paths_check(driver, (brand, brand_how), targets[0].sm if targets else None)
    plan = make_plan(load_matrix(ROOT / "matrix.yaml"))
    facts = HostFacts(driver=driver, gpus=gpus)
    picks = {}
    for image in sorted({v.image for v in plan.variants}):
        try:
            tag, notes = pick(plan, image, facts, None, brand)
            picks[image] = {"tag": tag, "notes": notes}
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not stop
            picks[image] = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "proc_driver_version": proc.read_text(errors="replace").strip() if proc.exists() else None,
        "cudacompat_driver_version": cudacompat.driver_version(),
        "query_gpus": {"driver": driver, "how": how,
                       "gpus": [{"name": g.name, "cc": g.cc, "sm": g.sm, "nvml_brand": g.nvml_brand,
                                 "brand": g.brand} for g in gpus]},
        "brand_by_name": [compat.gpu_brand_of(g.name, None) for g in gpus],
        "gpu_brand_auto": {"brand": brand, "how": brand_how},
        "mixed_archs_note": mixed,
        "cuda_versions_check": check.__dict__,
        "pick": picks,
    }


def run_child(env: dict) -> dict:
    env = {**env, "PROBE_T0": repr(time.time())}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode:
        return {"rc": done.returncode, "stderr": done.stderr[-2000:]}
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["stderr_mopt_lines"] = [line for line in done.stderr.splitlines() if line.startswith("mopt:")]
    return record


def find_libcuda() -> list[Path]:
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = {Path(line.split("=>")[-1].strip()) for line in listing.splitlines() if "libcuda.so" in line}
    for folder in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu"):
        paths.update(Path(folder).glob("libcuda.so*"))
    return sorted(p for p in paths if p.exists())


def reexec_section(driver: str, rounds: int) -> dict:
    compat_dir = Path(tempfile.mkdtemp(prefix="mopt-compat-"))
    libs = find_libcuda()
    # a copy, not a link: the loader maps the file it opens, so /proc/self/maps then shows which
    # directory libcuda came from
    real = {lib.resolve() for lib in libs}
    for target in real:
        shutil.copy2(target, compat_dir / target.name)
    for lib in libs:
        link = compat_dir / lib.name
        if not link.exists():
            link.symlink_to(lib.resolve().name)
    base = {k: v for k, v in os.environ.items() if k not in ("MOPT_CUDA_COMPAT_APPLIED",)}
    base["MOPT_CUDA_COMPAT_DIR"] = str(compat_dir)
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if not Path("/proc/driver/nvidia/version").exists():
        # gVisor-like sandboxes hide the kernel module's file; give cudacompat the NVML driver instead.
        stand_in = compat_dir.parent / "mopt-probe-driver-version"
        stand_in.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  (probe stand-in)\n")
        base["PROBE_DRIVER_FILE"] = str(stand_in)
    major = int(driver.split(".")[0])
    cases = {"min_below_driver": f"{major - 80}.0", "min_above_driver": f"{major + 80}.0"}
    out = {"compat_dir": str(compat_dir), "libcuda_found": [str(p) for p in libs],
           "driver_file_stand_in": "PROBE_DRIVER_FILE" in base}
    for name, minimum in cases.items():
        runs = [run_child({**base, "MOPT_CUDA_MIN_DRIVER": minimum}) for _ in range(rounds)]
        times = [r["seconds_to_first_matmul"] for r in runs if "seconds_to_first_matmul" in r]
        out[name] = {"min_driver": minimum, "first": runs[0],
                     "median_seconds_to_first_matmul": statistics.median(times) if times else None,
                     "all_seconds": times}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    result = {"host": host_section()}
    driver = result["host"]["query_gpus"]["driver"] or result["host"]["cudacompat_driver_version"]
    result["reexec"] = reexec_section(driver, args.rounds) if driver else {"skipped": "no NVIDIA driver"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_host_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
