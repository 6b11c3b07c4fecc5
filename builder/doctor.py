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
from .errors import ConfigError, IncompatibleError, MoptError, quoted
from .plan import Plan
from .versions import cc_to_sm, normalize_driver, normalize_sm, parse_version, sm_major_minor, sm_to_cc

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
    cc: str | None  # "9.0"; None when the driver did not report it ("[N/A]")
    nvml_brand: str | None = None  # nvmlDeviceGetBrand as libnvidia-container names it: tesla, geforce ...

    @property
    def sm(self) -> str | None:
        """Its arch ("90"): from its compute capability, else (not reported) from its name in the GPU table;
        None when neither tells."""
        try:
            return cc_to_sm(self.cc or compat.gpu_compute_capability(self.name))
        except ConfigError:
            return None

    def describe(self) -> str:
        return f"GPU {self.index} ({self.name}, " + (f"sm_{self.sm})" if self.sm else "compute capability unknown)")

    @property
    def brand(self) -> str | None:
        """Its product line (datacenter, workstation, consumer, embedded); None when unknown."""
        return compat.gpu_brand_of(self.name, self.nvml_brand)


# nvmlBrandType_t values (nvml.h), named as libnvidia-container names them in NVIDIA_REQUIRE_* brands.
NVML_BRANDS = ("unknown", "quadro", "tesla", "nvs", "grid", "geforce", "titan", "vapps", "vpc", "vcs", "vws",
               "cloudgaming", "quadrortx", "nvidiartx", "nvidia", "geforcertx", "titanrtx")
BRAND_CHOICES = ("auto", *compat.GPU_BRANDS, "unknown")


def resolve_gpu_brand(choice: str, gpus: tuple[Gpu, ...]) -> tuple[str | None, str]:
    """(brand, how it was decided) for --gpu-brand: given, or (auto) the detected GPUs' common product line.
    A given brand that a GPU's known product line contradicts is refused: forward compatibility would be
    claimed for a GPU that fails with error 804."""
    if choice == "unknown":
        return None, "given as unknown"
    if choice != "auto":
        clash = next((g for g in gpus if g.brand not in (None, choice)), None)
        if clash is not None:
            how = f"NVML brand {clash.nvml_brand}" if clash.nvml_brand else "the knowledge base's GPU table (sm.gpus)"
            raise ConfigError(f"--gpu-brand {choice} contradicts {clash.name}, a {clash.brand} GPU by {how}; "
                              "leave --gpu-brand at auto, or name the GPU you mean")
        return choice, "given"
    if not gpus:
        return None, "no GPU detected"
    kinds = {g.brand for g in gpus}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop(), f"detected: {gpus[0].name}" + (f" (NVML brand {gpus[0].nvml_brand})"
                                                            if gpus[0].nvml_brand else "")
    return None, "detected GPUs of unknown or mixed product lines: " + ", ".join(g.name for g in gpus)


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
            brand = pynvml.nvmlDeviceGetBrand(handle)
            gpus.append(Gpu(i, name.decode() if isinstance(name, bytes) else name, f"{major}.{minor}",
                            NVML_BRANDS[brand] if 0 <= brand < len(NVML_BRANDS) else None))
        return (driver.decode() if isinstance(driver, bytes) else driver), tuple(gpus), "NVML"
    except Exception:  # noqa: BLE001 - pynvml absent or no driver: fall back to nvidia-smi
        pass
    result = _run(["nvidia-smi", "--query-gpu=index,name,compute_cap,driver_version", "--format=csv,noheader"])
    if result is None or result.returncode != 0:
        return None, (), "nvidia-smi not found" if result is None else "nvidia-smi failed"
    gpus, driver = [], None
    for position, line in enumerate(result.stdout.strip().splitlines()):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:  # fields it cannot read come as "[N/A]": kept as unknown, not fatal
            index = int(parts[0]) if parts[0].isascii() and parts[0].isdigit() else position
            name = ", ".join(parts[1:-2])  # a name may hold commas; the last two fields are fixed
            gpus.append(Gpu(index, name, parts[-2] if _CC.fullmatch(parts[-2]) else None))
            driver = parts[-1]  # as reported: valid_driver() decides whether it can be read
    return driver, tuple(gpus), "nvidia-smi"


_CC = re.compile(r"\d{1,2}\.\d", re.ASCII)


def valid_driver(driver: str | None) -> str | None:
    """The driver version if the knowledge base can read it (a branch or up to three parts), else None."""
    try:
        return normalize_driver(driver)  # None and "" are not one either
    except ConfigError:
        return None


def gpus_of_arch(gpus: tuple[Gpu, ...], sm: str | None) -> tuple[Gpu, ...]:
    """The host's GPUs a question is about: those of arch `sm` when it is given, else target_gpus'."""
    if sm is None:
        return target_gpus(gpus)[0]
    want = normalize_sm(sm)
    return tuple(g for g in gpus if g.sm == want)


def target_gpus(gpus: tuple[Gpu, ...]) -> tuple[tuple[Gpu, ...], str]:
    """The GPUs a tag is picked for: all of them when they share an arch, else those of the first GPU
    whose arch is known (an engine is built for one arch); and a note when some are left out."""
    known = [g for g in gpus if g.sm]
    if not known:
        return (), ""
    chosen = tuple(g for g in known if g.sm == known[0].sm)
    if len(chosen) == len(gpus):
        return chosen, ""
    others = sorted({g.sm for g in known} - {known[0].sm}, key=sm_major_minor)
    hint = f"; for the others pass {' or '.join('--sm ' + sm for sm in others)}" if others else ""
    return chosen, (f"this host's GPUs differ ({'; '.join(g.describe() for g in gpus)}): picked for "
                    f"sm_{known[0].sm}, the arch of GPU {known[0].index}{hint}")


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


def cuda_paths_check(driver: str | None, brand: tuple[str | None, str], sm: str | None = None) -> Check:
    """Which CUDA versions of the knowledge base this driver runs natively, and which through forward
    compatibility (a data-center GPU of arch `sm` and a supported branch), for the GPU's product line."""
    kind, how = brand
    if not driver:
        return Check("cuda-versions", "warn", "the driver did not report its version: the CUDA versions it runs "
                                              "are unknown", "nvidia-smi should print the driver version")
    native, forward, none = [], [], []
    for row in compat.knowledge_base().rows("cuda", "toolkits"):
        way = compat.driver_path(row["version"], driver, kind, sm=sm)
        {"native": native, "forward": forward}.get(way.path, none).append(row["version"])
    detail = (f"product line {kind or 'unknown'} ({how}); driver {driver}: CUDA {', '.join(native) or 'none'} "
              f"natively")
    if forward:
        pkg = compat.forward_compat(forward[-1])["package"]
        detail += f"; CUDA {', '.join(forward)} through forward compatibility (images carry {pkg} and the like)"
    fix = ""
    if none and kind is None:
        fix = "if this is a data-center GPU, pass --gpu-brand datacenter to see its forward-compatible CUDA versions"
    return Check("cuda-versions", "ok" if native or forward else "warn", detail, fix)


def inspect_host(gpu_brand: str = "auto") -> HostFacts:
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
    reported, gpus, how = query_gpus()
    driver = valid_driver(reported)
    if gpus:
        if driver:
            checks.append(Check("nvidia-driver", "ok", f"driver {driver} (via {how})"))
        else:
            checks.append(Check("nvidia-driver", "warn", f"the driver reported no readable version "
                                                         f"({quoted(reported)}, via {how})",
                                "nvidia-smi --query-gpu=driver_version --format=csv should print e.g. 550.54.14"))
        for gpu in gpus:
            if gpu.sm:
                cc = gpu.cc or f"not reported, {sm_to_cc(gpu.sm)} by the GPU table"
                checks.append(Check(f"gpu{gpu.index}", "ok", f"{gpu.name}, compute capability {cc} "
                                                            f"(sm_{gpu.sm}), product line {gpu.brand or 'unknown'}"))
            else:
                checks.append(Check(f"gpu{gpu.index}", "warn", f"{gpu.name}: compute capability not reported, and "
                                                              "the name is not in the GPU table; no tag can be "
                                                              "matched to it", "pass --sm to mopt pick (e.g. --sm 90)"))
        targets, _ = target_gpus(gpus)
        try:
            brand = resolve_gpu_brand(gpu_brand, targets or gpus)
            checks.append(cuda_paths_check(driver, brand, targets[0].sm if targets else None))
        except ConfigError as err:
            checks.append(Check("cuda-versions", "fail", err.message, "leave --gpu-brand at auto"))
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


@dataclass(frozen=True)
class Candidate:
    """A published tag as pick weighs it: from the matrix's plan, or from an image's labels in a registry."""

    tag: str
    flavour: str
    device: str
    sm: str | None = None
    cuda: str | None = None
    min_driver: str | None = None

    @classmethod
    def of_variant(cls, v) -> Candidate:
        return cls(v.tag, v.flavour, v.device, v.resolved.sm, v.resolved.cuda, v.resolved.min_driver)

    @classmethod
    def of_labels(cls, tag: str, labels: dict[str, str]) -> Candidate | None:
        """None for an image that is not a mopt serving image of this tag (a long tag, a model runtime)."""
        def label(name: str) -> str | None:
            value = labels.get(f"io.mopt.{name}")
            return None if value in (None, "", "none") else value

        if labels.get("org.opencontainers.image.ref.name") != tag or label("device") not in ("cpu", "cuda"):
            return None
        sm, cuda, floor = label("sm"), label("cuda"), label("driver.min")
        # Labels come from whoever pushed the image: a value of the wrong shape makes it no candidate.
        if label("device") == "cuda" and not (sm and re.fullmatch(r"\d{2,3}", sm)
                                              and cuda and re.fullmatch(r"\d+\.\d+", cuda)
                                              and (floor is None or re.fullmatch(r"\d+(\.\d+){0,2}", floor))):
            return None
        return cls(tag, label("flavour") or "", label("device"), sm, cuda, floor)


def plan_candidates(plan: Plan, image: str, prefer_flavour: str | None = None) -> list[Candidate]:
    variants = [v for v in plan.variants if v.image == image]
    if not variants:
        raise ConfigError(f"image {image!r} is not in the matrix (images: "
                          f"{', '.join(sorted({v.image for v in plan.variants}))})")
    return flavour_of(image, [Candidate.of_variant(v) for v in variants], prefer_flavour)


def flavour_of(image: str, candidates: list[Candidate], prefer_flavour: str | None) -> list[Candidate]:
    if not prefer_flavour:
        return candidates
    chosen = [c for c in candidates if c.flavour == prefer_flavour]
    if not chosen:
        raise ConfigError(f"image {image!r} has no flavour {prefer_flavour!r} (flavours: "
                          f"{', '.join(sorted({c.flavour for c in candidates}))})")
    return chosen


def pick(plan: Plan, image: str, facts: HostFacts, prefer_flavour: str | None = None,
         gpu_brand: str | None = None, cpu_fallback: bool = False) -> tuple[str, list[str]]:
    """pick_among the matrix's planned tags of IMAGE."""
    return pick_among(plan_candidates(plan, image, prefer_flavour), image, facts, gpu_brand, cpu_fallback)


def pick_among(candidates: list[Candidate], image: str, facts: HostFacts, gpu_brand: str | None = None,
               cpu_fallback: bool = False) -> tuple[str, list[str]]:
    """The published tag of `image` that fits this host, and why each other candidate does not (and,
    where the tag runs through forward compatibility, how). A host with a GPU that no tag fits gets
    IncompatibleError unless CPU_FALLBACK: a cpu tag there is a silent slowdown, not an answer."""
    why_not = []
    targets, mixed = target_gpus(facts.gpus)
    if mixed:
        why_not.append(mixed)
    if facts.gpus and not targets:  # a GPU is there: the cpu tag would be a wrong answer, not a fallback
        raise ConfigError(f"no GPU of this host has a known arch ({'; '.join(g.describe() for g in facts.gpus)}): "
                          "its compute capability was not reported and its name is not in the GPU table; pass "
                          "--sm (e.g. --sm 90)")
    if targets:
        sm = targets[0].sm
        same_arch = [c for c in candidates if c.device == "cuda" and c.sm == sm]
        built = sorted({c.sm for c in candidates if c.sm}, key=sm_major_minor)  # a cpu tag has no sm
        if not built:
            why_not.append(f"{image} has no GPU tags")
        elif not same_arch:
            why_not.append(f"no tag is built for sm_{sm} "
                           f"(engines are tied to the GPU arch; built: {', '.join('sm_' + s for s in built)})")
        fits, forward = [], {}
        for c in same_arch:
            try:
                way = (compat.driver_path(c.cuda, facts.driver, gpu_brand, sm=sm)
                       if c.min_driver and c.cuda and facts.driver else None)
            except MoptError as exc:  # a CUDA this mopt does not know (a newer release's tag)
                why_not.append(f"{c.tag}: {exc.message}")
                continue
            if way is None or way.path == "native":
                fits.append(c)
            elif way.path == "forward":
                fits.append(c)
                forward[c.tag] = way
            else:
                why_not.append(f"{c.tag}: CUDA {c.cuda} needs driver >= {c.min_driver}, this host has "
                               f"{facts.driver}" + (f"; {way.detail}" if way.detail else ""))
        if fits:
            # Newest CUDA that the driver runs (natively or through forward compatibility), default
            # flavour (first listed) on ties.
            order = {f: i for i, f in enumerate(dict.fromkeys(c.flavour for c in candidates))}
            best = max(fits, key=lambda c: (parse_version(c.cuda), -order[c.flavour]))  # a GPU tag has a CUDA
            if best.tag in forward:
                why_not.append(f"{best.tag} runs through forward compatibility: {forward[best.tag].detail}")
            return best.tag, why_not
    cpu = [c for c in candidates if c.device == "cpu"]
    if cpu and (not facts.gpus or cpu_fallback):
        reason = "no GPU on this host" if not facts.gpus else "no GPU tag fits this host (--cpu-fallback)"
        why_not.append(f"{reason}: using the cpu variant")
        return cpu[0].tag, why_not
    if cpu:
        why_not.append(f"{cpu[0].tag} would run on the CPU: pass --cpu-fallback to take it")
    detail = "; ".join(why_not) or "no NVIDIA GPU on this host and the image has no cpu variant"
    raise IncompatibleError(f"no published tag of {image} fits this host: {detail}")


def gpu_from_name(name: str) -> Gpu:
    """For `mopt pick --gpu 'NVIDIA A10'`: the compute capability from the knowledge base."""
    return Gpu(0, name, compat.gpu_compute_capability(name))


def facts_override(facts: HostFacts, gpu: str | None, sm: str | None, driver: str | None) -> HostFacts:
    """Let a deployer ask for another host than this one (`mopt pick --sm 86 --driver 535.54.03`): --gpu and
    --sm replace the GPUs, --driver the driver; what is not given stays this host's. A host driver that
    cannot be read is refused here, where a tag would be picked by it."""
    gpus = facts.gpus
    for flag, value in (("--gpu", gpu), ("--sm", sm), ("--driver", driver)):
        if value is not None and not value.strip():
            raise ConfigError(f"{flag} is empty")
    if gpu is not None:
        gpus = (gpu_from_name(gpu.strip()),)
    if sm is not None:
        want = normalize_sm(sm)
        pretend = Gpu(0, f"sm_{want}", sm_to_cc(want))
        if pretend.sm is None:
            raise ConfigError(f"--sm {quoted(sm)}: not a GPU architecture (compute capability {pretend.cc})")
        if gpu is not None and gpus[0].sm != want.removesuffix("a"):
            raise ConfigError(f"--gpu {quoted(gpu.strip())} is sm_{gpus[0].sm}, not sm_{want}: give one of them")
        # a GPU of this host with that arch keeps its name and product line; another arch is another GPU
        gpus = gpus if gpu is not None else (gpus_of_arch(facts.gpus, want) or (pretend,))
    if driver is not None:
        chosen = valid_driver(driver)
        if chosen is None:
            raise ConfigError(f"--driver {quoted(driver)}: expected a branch (535) or a version like 535.54.03")
    else:
        chosen = valid_driver(facts.driver)
        if facts.driver and facts.gpus and chosen is None:
            raise ConfigError(f"this host's driver reports version {quoted(facts.driver)}, which is not a driver "
                              "version; pass --driver (e.g. --driver 535.104.05)")
    return HostFacts(driver=chosen, gpus=gpus, docker_server=facts.docker_server,
                     runtimes=facts.runtimes, checks=facts.checks)

