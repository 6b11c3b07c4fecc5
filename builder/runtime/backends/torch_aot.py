"""torch.export + AOTInductor package (engine/model.pt2), CPU and CUDA.

The package is a C++ shared library (generated wrapper + kernels + weights). Loading it needs torch
alone: the loader calls torch's C++ package loader directly rather than through torch._inductor,
whose import chain (Dynamo, sympy, the compiler) costs seconds of every start.

The compile step loads the finished package in a fresh process before it ships: a .so that crashes
when loaded (e.g. built by a C++ compiler that linked its own libstdc++ into it, which then meets the
process's libstdc++) fails the build with the cause named, instead of shipping an image that dies at
start.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from ..errors import UsageError
from ..params import EngineParams
from ..sdpa import sdpa_kernels, sdpa_summary
from .torch_common import DTYPES, build_module, eager_reference, export_graph, inductor_options, tuned_example

ARTIFACT = "model.pt2"


def version() -> str:
    return torch.__version__


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    dtype = DTYPES[params.precision]
    module = build_module(model_dir, params, dtype, params.device)
    example = tuned_example(params, params.device, pad_left=params.pad_left)
    # On CUDA, SDPA's kernel choice is baked in here (no cuDNN by default: see sdpa.py).
    kernels = sdpa_kernels() if params.device == "cuda" else nullcontext()
    options = inductor_options(params.compile_mode)
    with torch.inference_mode(False), torch.no_grad(), kernels:
        exported, dims = export_graph(module, example, params)
        path = torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / ARTIFACT),
                                                        inductor_configs=dict(options))  # it adds keys
    check_loads_fresh(Path(path), params)
    recorded = {"tuned_for": "x".join(map(str, example[0].shape)), "inductor_options": options}
    if params.device == "cuda":
        recorded["sdpa"] = sdpa_summary(exported.graph)
    return {"artifact": Path(path).name, "export_dims": dims, "embedding_dim": int(module.body.config.hidden_size),
            "fingerprint": recorded}  # in engine.json


# Run by check_loads_fresh in a child: load the package the way load() does, call it once.
_LOAD_CHECK = """
import importlib, json, sys
torch_aot = importlib.import_module(sys.argv[3])
common = importlib.import_module(sys.argv[3].rpartition(".")[0] + ".torch_common")
params = torch_aot.EngineParams.from_dict(json.loads(sys.argv[2]))
run = torch_aot.load(sys.argv[1], params)
out = run(*common.example_inputs(min(2, params.max_batch), min(16, params.max_seq_len), "cpu", params.pad_left))
print("LOADED", tuple(out.shape))
"""


def check_loads_fresh(package: Path, params: EngineParams) -> None:
    """Load the package and call it in a fresh process: a crash there must fail the build, not the
    first container start."""
    # this module by its own name (builder.runtime... here, mopt_runtime... in images), from the dir above it
    root = Path(__file__).resolve().parents[len(__name__.split(".")) - 1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _LOAD_CHECK, str(package.parent), json.dumps(params.to_dict()),
                           __name__], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode == 0 and "LOADED" in proc.stdout:
        return
    how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited {proc.returncode}"
    detail = proc.stderr.strip().splitlines()[-1:] if proc.returncode > 0 else []
    raise RuntimeError(f"the compiled package {package.name} does not load: a fresh process loading it {how}"
                       f"{': ' + detail[0] if detail else ''}{cxx_runtime_hint(package)}")


def cxx_runtime_hint(package: Path) -> str:
    """Why a package's .so may crash at load: a C++ runtime of its own, linked in by the compiler."""
    import tempfile
    import zipfile

    readelf = shutil.which("readelf")
    if readelf is None:
        return ""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(package) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so")]
        if not names:
            return ""
        so = zf.extract(names[0], tmp)
        needed = subprocess.run([readelf, "-d", so], capture_output=True, text=True).stdout
    if "libstdc++.so" in needed:
        return ""
    compiler = os.environ.get("CXX") or "g++"
    return (f"; its .so does not link libstdc++.so dynamically: the C++ compiler ({compiler}) linked a "
            "libstdc++ of its own into it, which clashes with the one this Python process loaded; set CXX to "
            "the system's g++ (the one whose libstdc++ this process uses) and compile again")


def _package_runner(path: str):
    """torch's C++ package loader, called directly: torch._inductor's public wrapper would import
    Dynamo and the compiler first (seconds of a start). The wrapper where this torch lacks the class."""
    loader_cls = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_cls is None:
        from torch._inductor import aoti_load_package

        runner = aoti_load_package(path)
        return lambda ids, mask: runner(ids, mask)
    loader = loader_cls(path, "model", False, 1, -1)  # path, model name, single-threaded, runners, device index
    return lambda ids, mask: loader.run([ids, mask])[0]


def load(engine_dir: str | Path, params: EngineParams):
    runner = _package_runner(str(Path(engine_dir) / ARTIFACT))
    device = params.device

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = runner(input_ids.to(device).contiguous(), attention_mask.to(device).contiguous())
        return out.float().cpu()

    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    return eager_reference(model_dir, texts, params)


def prepare(device: str) -> None:
    """Nothing to warm: the package loader needs torch alone."""


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int) -> None:
    raise UsageError("torch-aot engines are served by mopt's own server, not exec_serve")
