"""Facts about the running host that an engine depends on; used by compile and by the guard."""
from __future__ import annotations

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

    sm = name = driver = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        sm, name, driver = f"{major}{minor}", torch.cuda.get_device_name(0), _driver_version()
    return HostFacts(torch=torch.__version__, cuda=torch.version.cuda, tensorrt=_tensorrt_version(),
                     sm=sm, gpu_name=name, driver=driver)
