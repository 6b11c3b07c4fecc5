"""`mopt base`: a Debian 12 base image made locally (no registry can be pulled from).

The rootfs is built with mmdebstrap (debootstrap as a fallback) with SOURCE_DATE_EPOCH from the
caller, packed into a tarball and turned into an image with ``docker import``. The build is
content-addressed: the key is the sha256 of everything that decides the rootfs and the image
config (suite, variant, mirror, components, sorted packages, epoch, slim excludes, --change
lines). A state file (``<state_dir>/<slug of name>.json``) records the key and the image id; when
the key matches and that image still exists, nothing is built. Imported images also carry the key
as the label ``io.mopt.base.key`` so a lost state file is recovered without a rebuild.

Same inputs + same mirror contents -> the same rootfs tarball (mmdebstrap honours
SOURCE_DATE_EPOCH). The mirror moves on over time; for bit-for-bit rebuilds pin a
snapshot.debian.org mirror URL (it is part of the key). The rootfs sha256 and the installed
package versions are recorded in the state file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .dockerclient import DockerCli, run_docker
from .errors import BuildError, ConfigError, EnvironmentProblem
from .hashing import sha256_bytes, sha256_file

KEY_VERSION = 1  # bump when the build recipe below changes in a way that changes the result
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SUITE = "bookworm"
DEFAULT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)
LABEL_KEY = "io.mopt.base.key"
LABEL_ROOTFS_SHA = "io.mopt.base.rootfs.sha256"

MMDEBSTRAP_VARIANTS = frozenset({"extract", "custom", "essential", "apt", "required", "minbase",
                                 "buildd", "important", "debootstrap", "standard"})
DEBOOTSTRAP_VARIANTS = frozenset({"minbase", "buildd"})

# What Debian's official "slim" images leave out (debuerreotype-slimify), written into the
# image's dpkg config so packages installed later are slim too.
SLIM_DPKG_OPTS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/lintian/overrides/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/man/*",
)
APT_OPTS = ('Acquire::Retries "3"', 'APT::Install-Recommends "false"')

_PKG_RE = re.compile(r"^[a-z0-9][a-z0-9+.\-]+(:[a-z0-9]+)?(=[A-Za-z0-9.+~:\-]+)?$")
_SUITE_RE = re.compile(r"^[a-z][a-z0-9\-]*$")
_NAME_RE = re.compile(r"^[a-z0-9]+(?:[._\-/][a-z0-9]+)*(?::[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127})?$")
_MIRROR_RE = re.compile(r"^(https?|file)://\S+$")

Log = Callable[[str], None]


@dataclass(frozen=True)
class BaseSpec:
    """What to build. ``packages`` is normalised to a sorted, de-duplicated tuple."""

    name: str  # image reference to import as, e.g. "mopt/base:debian12"
    epoch: int  # SOURCE_DATE_EPOCH for the rootfs
    packages: tuple[str, ...] = ()
    suite: str = DEFAULT_SUITE
    variant: str = "minbase"
    mirror: str = DEFAULT_MIRROR
    components: tuple[str, ...] = ("main",)
    slim: bool = True
    changes: tuple[str, ...] = DEFAULT_CHANGES  # `docker import --change` lines

    def __post_init__(self) -> None:
        pkgs = tuple(sorted({p.strip() for p in self.packages if p.strip()}))
        object.__setattr__(self, "packages", pkgs)
        object.__setattr__(self, "components", tuple(self.components))
        object.__setattr__(self, "changes", tuple(self.changes))
        bad = [p for p in pkgs if not _PKG_RE.match(p)]
        if bad:
            raise ConfigError(f"invalid Debian package name(s): {', '.join(bad)}", key="packages")
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"invalid image name {self.name!r} (want e.g. mopt/base:debian12)",
                              key="name")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"epoch must be a non-negative integer, got {self.epoch!r}", key="epoch")
        if not _SUITE_RE.match(self.suite):
            raise ConfigError(f"invalid suite {self.suite!r}", key="suite")
        if self.variant not in MMDEBSTRAP_VARIANTS:
            raise ConfigError(f"unknown variant {self.variant!r}; one of {sorted(MMDEBSTRAP_VARIANTS)}",
                              key="variant")
        if not _MIRROR_RE.match(self.mirror):
            raise ConfigError(f"mirror must be an http(s):// or file:// URL, got {self.mirror!r}",
                              key="mirror")
        if any(not _SUITE_RE.match(c) for c in self.components):
            raise ConfigError(f"invalid components {self.components!r}", key="components")

    @property
    def key(self) -> str:
        """sha256 over every input that decides the rootfs and the image config."""
        doc = {
            "v": KEY_VERSION,
            "suite": self.suite,
            "variant": self.variant,
            "mirror": self.mirror.rstrip("/"),
            "components": list(self.components),
            "packages": list(self.packages),
            "epoch": self.epoch,
            "slim": self.slim,
            "changes": list(self.changes),
        }
        return sha256_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


@dataclass(frozen=True)
class BaseImage:
    """A base image in the daemon and what made it (also the state file's content)."""

    name: str
    image_id: str
    key: str
    packages: tuple[str, ...]
    epoch: int
    created_seconds: float  # unix time the image was built
    build_seconds: float = 0.0  # how long the build took (0 when reused)
    size_bytes: int = 0
    suite: str = DEFAULT_SUITE
    variant: str = "minbase"
    mirror: str = DEFAULT_MIRROR
    tool: str = ""  # mmdebstrap / debootstrap
    rootfs_sha256: str = ""
    manifest: tuple[str, ...] = field(default=())  # installed "package=version" lines
    reused: bool = False  # True when this call built nothing

    def to_json(self) -> dict:
        doc = asdict(self)
        doc.pop("reused")
        doc["packages"] = list(self.packages)
        doc["manifest"] = list(self.manifest)
        return doc

    @classmethod
    def from_json(cls, doc: dict, *, reused: bool = False) -> BaseImage:
        known = {f for f in cls.__dataclass_fields__ if f != "reused"}
        kw = {k: v for k, v in doc.items() if k in known}
        kw["packages"] = tuple(kw.get("packages", ()))
        kw["manifest"] = tuple(kw.get("manifest", ()))
        return cls(**kw, reused=reused)


def state_path(state_dir: str | os.PathLike[str], name: str) -> Path:
    """Where the state of base ``name`` lives: ``<state_dir>/<name with / and : as _>.json``."""
    return Path(state_dir) / (re.sub(r"[/:@]", "_", name) + ".json")


def pick_tool(preferred: str | None = None) -> tuple[str, str]:
    """(tool name, path): mmdebstrap if installed, else debootstrap; EnvironmentProblem if neither."""
    order = [preferred] if preferred else ["mmdebstrap", "debootstrap"]
    for tool in order:
        if tool not in ("mmdebstrap", "debootstrap"):
            raise ConfigError(f"unknown rootfs tool {tool!r} (mmdebstrap or debootstrap)")
        path = shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        if path:
            return tool, path
    raise EnvironmentProblem(
        f"no rootfs builder found (tried {', '.join(order)}); install one: "
        "`apt-get install mmdebstrap` (preferred) or `apt-get install debootstrap` "
        "(or run scripts/setup.sh)")


# ------------------------------------------------------------------------------------ helpers
def _image_id(docker: DockerCli, ref: str) -> str | None:
    res = run_docker(["image", "inspect", "--format", "{{.Id}}", ref], docker=docker, check=False)
    if res.returncode != 0:
        return None
    return res.stdout.strip() or None


def _image_info(docker: DockerCli, ref: str) -> dict | None:
    res = run_docker(["image", "inspect", ref], docker=docker, check=False)
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout)[0]
    except (ValueError, IndexError):
        return None


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """One builder per base name at a time (other processes wait, then find it built)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run_logged(argv: list[str], logfile: Path, env: dict[str, str], what: str,
                log: Log, heartbeat_s: float = 15.0) -> None:
    """Run a long tool with its output in ``logfile``; print a heartbeat; BuildError on failure."""
    with open(logfile, "ab") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
        start = last = time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - last >= heartbeat_s:
                log(f"  ... {what} still running ({now - start:.0f}s)")
                last = now
    if proc.returncode != 0:
        tail = "\n".join(logfile.read_text(errors="replace").strip().splitlines()[-20:])
        raise BuildError(f"{what} failed (exit {proc.returncode}); full log: {logfile}\n{tail}")


def _tool_env(epoch: int) -> dict[str, str]:
    env = dict(os.environ)
    env["SOURCE_DATE_EPOCH"] = str(epoch)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    env["LC_ALL"] = "C.UTF-8"
    env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
    return env


_MANIFEST_FMT = "${binary:Package}=${Version}\\n"


def _build_rootfs_mmdebstrap(tool_path: str, spec: BaseSpec, tarball: Path, manifest: Path,
                             logfile: Path, log: Log) -> None:
    argv = [tool_path, f"--variant={spec.variant}", "--mode=auto", "--format=tar",
            f"--components={','.join(spec.components)}"]
    if spec.packages:
        argv.append(f"--include={','.join(spec.packages)}")
    for opt in APT_OPTS:
        argv.append(f"--aptopt={opt}")
    if spec.slim:
        for opt in SLIM_DPKG_OPTS:
            argv.append(f"--dpkgopt={opt}")
    # Record installed versions (provenance) from inside the finished chroot.
    argv.append(f"--customize-hook=chroot \"$1\" dpkg-query -W -f='{_MANIFEST_FMT}' > '{manifest}'")
    argv += [spec.suite, str(tarball), spec.mirror]
    _run_logged(argv, logfile, _tool_env(spec.epoch), "mmdebstrap", log)


def _build_rootfs_debootstrap(tool_path: str, spec: BaseSpec, tarball: Path, manifest: Path,
                              workdir: Path, logfile: Path, log: Log) -> None:
    if spec.variant not in DEBOOTSTRAP_VARIANTS:
        raise ConfigError(f"variant {spec.variant!r} needs mmdebstrap; debootstrap knows "
                          f"{sorted(DEBOOTSTRAP_VARIANTS)} (apt-get install mmdebstrap)", key="variant")
    root = workdir / "rootfs"
    env = _tool_env(spec.epoch)
    argv = [tool_path, f"--variant={spec.variant}", f"--components={','.join(spec.components)}"]
    if spec.packages:
        argv.append(f"--include={','.join(spec.packages)}")
    argv += [spec.suite, str(root), spec.mirror]
    _run_logged(argv, logfile, env, "debootstrap", log)
    # Match what mmdebstrap does: config, clean apt caches and logs, clamp mtimes, sorted tar.
    if spec.slim:
        (root / "etc/dpkg/dpkg.cfg.d/99mopt-slim").write_text("\n".join(SLIM_DPKG_OPTS) + "\n")
    (root / "etc/apt/apt.conf.d/99mopt").write_text("".join(f"{o};\n" for o in APT_OPTS))
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (root / sub).glob("*"):
            if p.is_file():
                p.unlink()
    for p in (root / "var/log").rglob("*"):
        if p.is_file():
            p.unlink()
    res = subprocess.run(["chroot", str(root), "dpkg-query", "-W", f"-f={_MANIFEST_FMT}"],
                         capture_output=True, text=True, env=env)
    manifest.write_text(res.stdout)
    _run_logged(["tar", "-C", str(root), "--sort=name", "--numeric-owner", f"--mtime=@{spec.epoch}",
                 "--clamp-mtime", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
                 "-cf", str(tarball), "."], logfile, env, "tar rootfs", log)
    shutil.rmtree(root, ignore_errors=True)


def _write_state(path: Path, image: BaseImage) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(image.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # unreadable state is treated as absent: the image is rebuilt


def _ensure_tag(docker: DockerCli, image_id: str, name: str, log: Log) -> None:
    if _image_id(docker, name) != image_id:
        run_docker(["tag", image_id, name], docker=docker)
        log(f"base {name}: re-tagged {image_id[:19]}")


# ------------------------------------------------------------------------------------ public
def ensure_base(spec: BaseSpec, state_dir: str | os.PathLike[str], docker: DockerCli,
                log: Log = print, *, tool: str | None = None,
                work_dir: str | os.PathLike[str] | None = None) -> BaseImage:
    """Make sure the base image ``spec.name`` exists for ``spec.key``; build it if not.

    Skips the build when ``<state_dir>/<slug>.json`` has the same key and its image id still
    exists in the daemon (re-tagging ``spec.name`` if it was moved), or when the image named
    ``spec.name`` carries the same key label (state file lost). ``tool`` forces mmdebstrap or
    debootstrap; ``work_dir`` is where the rootfs tarball is made (default: system temp).
    The full tool output goes to ``<state_dir>/<slug>.build.log``.
    """
    key = spec.key
    spath = state_path(state_dir, spec.name)
    with _locked(spath.with_suffix(".lock")):
        state = _read_state(spath)
        if state and state.get("key") == key and state.get("image_id"):
            if _image_id(docker, state["image_id"]):
                _ensure_tag(docker, state["image_id"], spec.name, log)
                log(f"base {spec.name}: up to date (key {key[:12]}, image {state['image_id'][:19]}); "
                    "nothing to build")
                image = BaseImage.from_json(state, reused=True)
                if not image.rootfs_sha256:  # a state recorded without it (recovered by an older mopt)
                    info = _image_info(docker, state["image_id"]) or {}
                    labels = (info.get("Config") or {}).get("Labels") or {}
                    if labels.get(LABEL_ROOTFS_SHA):
                        image = replace(image, rootfs_sha256=labels[LABEL_ROOTFS_SHA])
                        _write_state(spath, image)
                return image
            log(f"base {spec.name}: state names image {state['image_id'][:19]} which is gone; rebuilding")

        info = _image_info(docker, spec.name)
        labels = ((info or {}).get("Config") or {}).get("Labels") or {}
        if info and labels.get(LABEL_KEY) == key:
            image = BaseImage(name=spec.name, image_id=info["Id"], key=key, packages=spec.packages,
                              epoch=spec.epoch, created_seconds=time.time(),
                              size_bytes=int(info.get("Size") or 0), suite=spec.suite,
                              variant=spec.variant, mirror=spec.mirror, tool="unknown (state recovered)",
                              rootfs_sha256=labels.get(LABEL_ROOTFS_SHA, ""), reused=True)
            _write_state(spath, image)
            log(f"base {spec.name}: image already has key {key[:12]}; recorded state, nothing to build")
            return image

        return _build(spec, spath, docker, log, tool, work_dir)


def _build(spec: BaseSpec, spath: Path, docker: DockerCli, log: Log, tool: str | None,
           work_dir: str | os.PathLike[str] | None) -> BaseImage:
    key = spec.key
    tool_name, tool_path = pick_tool(tool)
    if tool_name == "debootstrap" and spec.variant not in DEBOOTSTRAP_VARIANTS:
        raise ConfigError(f"variant {spec.variant!r} needs mmdebstrap (apt-get install mmdebstrap)",
                          key="variant")
    logfile = spath.with_suffix(".build.log")
    logfile.parent.mkdir(parents=True, exist_ok=True)
    logfile.write_text("")
    pk = ", ".join(spec.packages) if spec.packages else "(none)"
    log(f"base {spec.name}: building {spec.suite}/{spec.variant} with {tool_name} "
        f"(key {key[:12]}, SOURCE_DATE_EPOCH={spec.epoch}, extra packages: {pk}; log: {logfile})")
    t0 = time.monotonic()
    if work_dir is not None:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mopt-base-", dir=work_dir) as tmp:
        tmpdir = Path(tmp)
        tarball = tmpdir / "rootfs.tar"
        manifest = tmpdir / "manifest.txt"
        if tool_name == "mmdebstrap":
            _build_rootfs_mmdebstrap(tool_path, spec, tarball, manifest, logfile, log)
        else:
            _build_rootfs_debootstrap(tool_path, spec, tarball, manifest, tmpdir, logfile, log)
        if not tarball.is_file():
            raise BuildError(f"{tool_name} produced no tarball; see {logfile}")
        rootfs_sha = sha256_file(tarball)
        t_rootfs = time.monotonic() - t0
        log(f"base {spec.name}: rootfs {tarball.stat().st_size / 1e6:.0f} MB "
            f"(sha256 {rootfs_sha[:12]}) in {t_rootfs:.0f}s; importing")
        changes = [*spec.changes, f"LABEL {LABEL_KEY}={key}", f"LABEL io.mopt.base.epoch={spec.epoch}",
                   f"LABEL io.mopt.base.suite={spec.suite}",
                   f"LABEL {LABEL_ROOTFS_SHA}={rootfs_sha}"]
        argv = ["import"]
        for c in changes:
            argv += ["--change", c]
        argv += ["--message", f"mopt base {spec.suite}/{spec.variant} key {key}", str(tarball), spec.name]
        res = run_docker(argv, docker=docker, timeout=600)
        image_id = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        manifest_lines = tuple(ln for ln in manifest.read_text().splitlines() if ln) \
            if manifest.is_file() else ()
    info = _image_info(docker, spec.name)
    if not info:
        raise BuildError(f"docker import reported {image_id!r} but {spec.name} is not in the daemon")
    image = BaseImage(
        name=spec.name, image_id=info["Id"], key=key, packages=spec.packages, epoch=spec.epoch,
        created_seconds=time.time(), build_seconds=round(time.monotonic() - t0, 1),
        size_bytes=int(info.get("Size") or 0), suite=spec.suite, variant=spec.variant,
        mirror=spec.mirror, tool=tool_name, rootfs_sha256=rootfs_sha, manifest=manifest_lines,
        reused=False,
    )
    _write_state(spath, image)
    log(f"base {spec.name}: built {image.image_id[:19]} ({image.size_bytes / 1e6:.0f} MB, "
        f"{len(manifest_lines)} packages) in {image.build_seconds:.0f}s")
    return image


def load_base(state_dir: str | os.PathLike[str], name: str) -> BaseImage | None:
    """The recorded state of base ``name``, or None."""
    doc = _read_state(state_path(state_dir, name))
    return BaseImage.from_json(doc) if doc else None


def spec_from_mapping(name: str, doc: dict, *, default_epoch: int | None = None) -> BaseSpec:
    """Build a BaseSpec from a config mapping (keys as BaseSpec's fields); ConfigError on junk."""
    allowed = set(BaseSpec.__dataclass_fields__) - {"name"}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise ConfigError(f"unknown base option(s): {', '.join(unknown)}", key=name)
    kw = dict(doc)
    if "epoch" not in kw:
        if default_epoch is None:
            raise ConfigError("missing epoch (SOURCE_DATE_EPOCH for the rootfs)", key=name)
        kw["epoch"] = default_epoch
    for seq in ("packages", "components", "changes"):
        if seq in kw:
            val = kw[seq]
            if isinstance(val, str) or not isinstance(val, Iterable):
                raise ConfigError(f"{seq} must be a list", key=f"{name}.{seq}")
            kw[seq] = tuple(str(v) for v in val)
    return BaseSpec(name=name, **kw)


__all__ = ["BaseSpec", "BaseImage", "ensure_base", "load_base", "pick_tool", "spec_from_mapping",
           "state_path", "DEFAULT_MIRROR", "KEY_VERSION"]
