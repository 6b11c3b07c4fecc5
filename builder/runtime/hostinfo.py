"""Facts about the running host that an engine depends on; used by compile and by the guard."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostFacts:
    torch: str
    cuda: str | None  # torch.version.cuda: the CUDA the running torch was built for
    tensorrt: str | None
    sm: str | None  # compute capability of GPU 0 as "90", or None without a usable GPU
    gpu_name: str | None
    driver: str | None
    gpu_problem: str | None = None  # why there is no usable GPU, where that was looked into (host_facts)

    def to_dict(self) -> dict:
        return asdict(self)


def _tensorrt_version() -> str | None:
    try:
        import tensorrt  # noqa: F401  (optional; only images of the tensorrt backend have it)
    except Exception:
        return None
    return getattr(tensorrt, "__version__", None)


# The kernel module's version line, e.g. "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  ..."
PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
_NVRM = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")


def _driver_version() -> str | None:
    # The kernel module's file first: instant, where pynvml may be absent and nvidia-smi takes ~1 s.
    try:
        match = _NVRM.search(PROC_DRIVER_VERSION.read_text())
        if match:
            return match.group(1)
    except OSError:
        pass
    try:
        import pynvml  # optional

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0].strip() or None
    except Exception:
        return None


def host_facts() -> HostFacts:
    import torch

    sm = name = driver = problem = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        sm, name, driver = f"{major}{minor}", torch.cuda.get_device_name(0), _driver_version()
    else:
        problem = gpu_problem(torch.version.cuda)
    return HostFacts(torch=torch.__version__, cuda=torch.version.cuda, tensorrt=_tensorrt_version(),
                     sm=sm, gpu_name=name, driver=driver, gpu_problem=problem)


# cuInit's answers worth naming (CUDA driver API, cuda.h CUresult).
_CU_INIT_ERRORS = {
    35: "the NVIDIA driver is older than this image's CUDA needs (CUDA_ERROR_INSUFFICIENT_DRIVER)",
    100: "the NVIDIA driver is loaded but no GPU is visible to this container (CUDA_ERROR_NO_DEVICE): "
         "check --gpus and NVIDIA_VISIBLE_DEVICES",
    999: "the NVIDIA driver failed to initialise (CUDA_ERROR_UNKNOWN): see the host's dmesg and nvidia-smi",
}


def gpu_problem(cuda: str | None, load=ctypes.CDLL) -> str:
    """Why torch sees no GPU, in words a user can act on: a CPU build, no driver in the container (the
    NVIDIA container toolkit mounts libcuda.so.1 only into a container started with GPUs), or what the
    driver's cuInit answered."""
    if not cuda:
        return "this image's torch is a CPU build"
    try:
        libcuda = load("libcuda.so.1")
    except OSError:
        return ("no NVIDIA driver in this container (libcuda.so.1 not found): start it with --gpus all on a host "
                "with the NVIDIA driver and the NVIDIA container toolkit")
    try:
        code = int(libcuda.cuInit(0))
    except Exception as exc:  # an unusual libcuda: say what happened, not a traceback
        return f"the NVIDIA driver's cuInit could not be called ({type(exc).__name__})"
    if code == 0:
        return "the NVIDIA driver initialised, but torch found no usable GPU"
    return _CU_INIT_ERRORS.get(code, f"the NVIDIA driver's cuInit failed with CUresult {code}")
