"""mopt doctor and mopt pick: what a deployer's host has, and which published tag fits it.

Each check reports ok / warn / fail with a fix hint. Works, with clear output, on a host without a
GPU: the GPU checks say so and `pick` names the cpu tag.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import compat
from .errors import ConfigError, IncompatibleError
from .plan import Plan
from .versions import cc_to_sm, parse_version

MIN_SHM_MIB = 1024
MIN_FREE_GIB = 20


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | info
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    cc: str  # "9.0"

    @property
    def sm(self) -> str:
        return cc_to_sm(self.cc)


@dataclass(frozen=True)
class HostFacts:
    driver: str | None = None
    gpus: tuple[Gpu, ...] = ()
    docker_server: str | None = None
    runtimes: tuple[str, ...] = ()
    checks: tuple[Check, ...] = field(default=())


def _run(argv: list[str], timeout: float = 15) -> subprocess.CompletedProcess | None:
    if not shutil.which(argv[0]) and not Path(argv[0]).exists():
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def query_gpus() -> tuple[str | None, tuple[Gpu, ...], str]:
    """(driver version, GPUs, how): NVML through pynvml if installed, else nvidia-smi."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else name, f"{major}.{minor}"))
        return (driver.decode() if isinstance(driver, bytes) else driver), tuple(gpus), "NVML"
    except Exception:  # noqa: BLE001 - pynvml absent or no driver: fall back to nvidia-smi
        pass
    result = _run(["nvidia-smi", "--query-gpu=index,name,compute_cap,driver_version", "--format=csv,noheader"])
    if result is None or result.returncode != 0:
        return None, (), "nvidia-smi not found" if result is None else "nvidia-smi failed"
    gpus, driver = [], None
    for line in result.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append(Gpu(int(parts[0]), parts[1], parts[2]))
            driver = parts[3]
    return driver, tuple(gpus), "nvidia-smi"


def _json_or_empty(text: str) -> dict:
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _version_at_least(version: str, floor: str) -> bool:
    """For versions a daemon reports ("20.10.24+dfsg1", "25.0.3-rd"); one that does not parse is not."""
    try:
        return parse_version(version.split("+")[0].split("-")[0]) >= parse_version(floor)
    except ConfigError:
        return False


def inspect_host() -> HostFacts:
    checks = []
    docker_bin = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
    info = _run([docker_bin, "info", "--format", "{{json .}}"])
    docker_server, runtimes = None, ()
    if info is None:
        checks.append(Check("docker", "fail", "no docker client found", "apt-get install docker.io"))
    else:
        data = _json_or_empty(info.stdout) if info.returncode == 0 else {}
        # Docker 20.10's client exits 0 without a daemon and reports it in ServerErrors instead.
        if not data.get("ServerVersion"):
            why = "; ".join(data.get("ServerErrors") or []) or info.stderr.strip() or "no server version reported"
            checks.append(Check("docker", "fail", "the daemon does not answer: " + why[:160],
                                "start it: dockerd > /var/log/dockerd.log 2>&1 & (or systemctl start docker)"))
        else:
            docker_server = data["ServerVersion"]
            runtimes = tuple(sorted((data.get("Runtimes") or {}).keys()))
            checks.append(Check("docker", "ok", f"daemon {docker_server} ({data.get('Driver')} storage)"))
    buildx = _run([docker_bin, "buildx", "version"])
    if buildx is not None and buildx.returncode == 0:
        checks.append(Check("buildkit", "ok", "docker buildx: " + buildx.stdout.strip()[:80]))
    elif docker_server and _version_at_least(docker_server, "18.09"):
        checks.append(Check("buildkit", "ok", f"{docker_bin} has BuildKit built in (DOCKER_BUILDKIT=1)"))
    else:
        checks.append(Check("buildkit", "warn", "no BuildKit-capable client found",
                            "install docker-buildx, or Debian's docker.io (/usr/bin/docker)"))
    driver, gpus, how = query_gpus()
    if gpus:
        checks.append(Check("nvidia-driver", "ok", f"driver {driver} (via {how})"))
        for gpu in gpus:
            checks.append(Check(f"gpu{gpu.index}", "ok", f"{gpu.name}, compute capability {gpu.cc} (sm_{gpu.sm})"))
        if "nvidia" in runtimes or Path("/etc/cdi/nvidia.yaml").exists() or shutil.which("nvidia-container-cli"):
            found = "nvidia runtime registered" if "nvidia" in runtimes else "NVIDIA container toolkit found"
            checks.append(Check("nvidia-container-runtime", "ok", found))
        else:
            checks.append(Check("nvidia-container-runtime", "fail", "GPUs present but Docker has no nvidia runtime",
                                "install nvidia-container-toolkit, then nvidia-ctk runtime configure --runtime=docker"))
    else:
        checks.append(Check("nvidia-driver", "info", f"no NVIDIA GPU or driver on this host ({how}): "
                                                     "only cpu variants can run here",
                            "GPU hosts need the NVIDIA driver (nvidia-smi should list the GPUs)"))
    shm = shutil.disk_usage("/dev/shm").total / 2**20 if Path("/dev/shm").exists() else 0
    checks.append(Check("shm", "ok" if shm >= MIN_SHM_MIB else "warn", f"/dev/shm {shm:.0f} MiB",
                        "" if shm >= MIN_SHM_MIB else f"run containers with --shm-size={MIN_SHM_MIB}m or more "
                                                      "(PyTorch data loaders and NCCL use shared memory)"))
    root = Path("/var/lib/docker") if Path("/var/lib/docker").exists() else Path("/")
    free = shutil.disk_usage(root).free / 2**30
    checks.append(Check("disk", "ok" if free >= MIN_FREE_GIB else "warn", f"{free:.0f} GiB free under {root}",
                        "" if free >= MIN_FREE_GIB else "GPU images are several GB: docker image prune"))
    return HostFacts(driver=driver, gpus=gpus, docker_server=docker_server, runtimes=runtimes, checks=tuple(checks))


def _driver_ok(driver: str, floor: str) -> bool:
    return parse_version(driver) >= parse_version(floor)


def pick(plan: Plan, image: str, facts: HostFacts, prefer_flavour: str | None = None) -> tuple[str, list[str]]:
    """The published tag of `image` that fits this host, and why each other candidate does not."""
    variants = [v for v in plan.variants if v.image == image]
    if not variants:
        raise ConfigError(f"image {image!r} is not in the matrix (images: "
                          f"{', '.join(sorted({v.image for v in plan.variants}))})")
    if prefer_flavour:
        variants = [v for v in variants if v.flavour == prefer_flavour]
        if not variants:
            raise ConfigError(f"image {image!r} has no flavour {prefer_flavour!r}")
    why_not = []
    if facts.gpus:
        sms = {g.sm for g in facts.gpus}
        same_arch = [v for v in variants if v.device == "cuda" and v.resolved.get("sm") in sms]
        if not same_arch:
            built = sorted({v.resolved["sm"] for v in variants if v.device == "cuda"}, key=lambda s: int(s[:3]))
            why_not.append(f"no tag is built for {', '.join('sm_' + s for s in sorted(sms))} "
                           f"(engines are tied to the GPU arch; built: {', '.join('sm_' + s for s in built)})")
        fits = []
        for v in same_arch:
            floor = v.resolved.get("min_driver")
            if floor and facts.driver and not _driver_ok(facts.driver, floor):
                why_not.append(f"{v.tag}: CUDA {v.resolved['cuda']} needs driver >= {floor}, this host has "
                               f"{facts.driver}")
            else:
                fits.append(v)
        if fits:
            # Newest CUDA that the driver runs, default flavour (first in the matrix) on ties.
            order = {f: i for i, f in enumerate(dict.fromkeys(v.flavour for v in variants))}
            best = max(fits, key=lambda v: (parse_version(v.resolved["cuda"]), -order[v.flavour]))
            return best.tag, why_not
    cpu = [v for v in variants if v.device == "cpu"]
    if cpu:
        reason = "no GPU on this host" if not facts.gpus else "no GPU tag fits this host"
        why_not.append(f"{reason}: using the cpu variant")
        return cpu[0].tag, why_not
    detail = "; ".join(why_not) or "no NVIDIA GPU on this host and the image has no cpu variant"
    raise IncompatibleError(f"no published tag of {image} fits this host: {detail}")


def gpu_from_name(name: str) -> Gpu:
    """For `mopt pick --gpu 'NVIDIA A10'`: the compute capability from the knowledge base."""
    return Gpu(0, name, compat.gpu_compute_capability(name))


_DRIVER = re.compile(r"^\d+(\.\d+){0,2}$")


def facts_override(facts: HostFacts, gpu: str | None, sm: str | None, driver: str | None) -> HostFacts:
    """Let a deployer ask for another host than this one (`mopt pick --sm 86 --driver 535.54.03`)."""
    from .versions import normalize_sm, sm_to_cc

    gpus = facts.gpus
    if gpu:
        gpus = (gpu_from_name(gpu),)
    if sm:
        gpus = (Gpu(0, gpus[0].name if gpus else f"sm_{normalize_sm(sm)}", sm_to_cc(normalize_sm(sm))),)
    if driver and not _DRIVER.match(driver):
        raise ConfigError(f"--driver {driver!r}: expected a version like 535.54.03")
    return HostFacts(driver=driver or facts.driver, gpus=gpus, docker_server=facts.docker_server,
                     runtimes=facts.runtimes, checks=facts.checks)

