"""`mopt warm IMAGE --model DIR --cache DIR`: a model runtime image's first-start compile, run ahead of
time on a host, so a fleet of the same GPU, driver and image starts from a filled engine cache (or an
air-gapped site receives one). The compile runs in the image itself (`python -m mopt_runtime warm`,
builder/runtime/modelcache.py), hardened and without a network, on the host's GPU for a CUDA image."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .dockerclient import DockerCli, run_docker
from .errors import BuildError, ConfigError

CONTAINER_MODEL = "/model"
CONTAINER_CACHE = "/cache"


@dataclass(frozen=True)
class WarmResult:
    image: str
    key: str
    outcome: str  # "compiled", "rebuilt" or "hit"
    seconds: float
    engine_dir: Path  # on the host


def _image_config(docker: DockerCli, image: str) -> dict:
    found = run_docker(["image", "inspect", "--format", "{{json .Config}}", image], docker=docker, check=False,
                       timeout=60)
    if found.returncode != 0:
        raise ConfigError(f"{image}: no such image here (docker pull it first)")
    return json.loads(found.stdout)


CACHE_ENTRIES = {"engines", "digests"}  # what a mopt engine cache holds at its top


def _cache_user(config: dict, cache: Path) -> str:
    """Who the compile runs as: the image's user when mopt runs as root (the cache dir and its two top
    directories are handed to it, so the served containers, which run as that user, can lock and write
    entries), else the caller. Nothing else is chowned: no recursion, no symlink followed."""
    if os.getuid() != 0:
        return f"{os.getuid()}:{os.getgid()}"
    user = config.get("User") or "0"
    uid, _, gid = user.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ConfigError(f"the image's user {user!r} is not numeric: cannot hand {cache} to it")
    for path in (cache, *(cache / name for name in sorted(CACHE_ENTRIES))):
        if path.is_dir() and not path.is_symlink():
            os.chown(path, int(uid), int(gid or uid), follow_symlinks=False)
    return f"{uid}:{gid or uid}"


def _check_paths(model: Path, cache: Path, runtime_args: tuple[str, ...]) -> None:
    if not (model / "config.json").is_file():
        raise ConfigError(f"--model {model}: not a Hugging Face model directory (no config.json)")
    outside = [p for p in model.rglob("*") if p.is_symlink() and not p.resolve().is_relative_to(model)]
    if outside:
        raise ConfigError(f"--model {model}: {outside[0].relative_to(model)} links outside the directory (a hub "
                          "cache snapshot?): the container would not see its target; copy the files (cp -L)")
    if cache.is_symlink() or (cache.exists() and not cache.is_dir()):
        raise ConfigError(f"--cache {cache}: not a directory")
    if cache.is_dir() and set(p.name for p in cache.iterdir()) - CACHE_ENTRIES:
        raise ConfigError(f"--cache {cache}: not empty and not a mopt engine cache (it holds more than "
                          f"{' and '.join(sorted(CACHE_ENTRIES))}/)")
    if cache.is_relative_to(model) or model.is_relative_to(cache):
        raise ConfigError(f"--cache {cache} and --model {model} overlap")
    given = {a.split("=", 1)[0] for a in runtime_args}
    for flag in ("--model-id", "--cache-dir"):
        if flag in given:
            raise ConfigError(f"{flag} is set by mopt warm (--model, --cache): drop it from the runtime's flags")


def warm(docker: DockerCli, image: str, model: Path, cache: Path, runtime_args: tuple[str, ...] = (),
         log=print) -> WarmResult:
    model, cache = model.resolve(), cache.absolute()
    _check_paths(model, cache, runtime_args)
    config = _image_config(docker, image)
    labels = config.get("Labels") or {}
    if labels.get("io.mopt.model") != "none":
        raise ConfigError(f"{image} is not a model runtime image (label io.mopt.model is "
                          f"{labels.get('io.mopt.model')!r}, not 'none'): warm REPOSITORY-runtime:TAG")
    cache.mkdir(parents=True, exist_ok=True)
    user = _cache_user(config, cache)
    argv = ["run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--user", user,
            "-v", f"{model}:{CONTAINER_MODEL}:ro", "-v", f"{cache}:{CONTAINER_CACHE}",
            "-e", f"MOPT_CACHE_DIR={CONTAINER_CACHE}"]
    if labels.get("io.mopt.device") == "cuda":
        argv += ["--gpus", "all"]
    argv += ["--entrypoint", "python", image, "-m", "mopt_runtime", "warm", "--model-id", CONTAINER_MODEL,
             *runtime_args]
    log(f"warming {image} with {model} into {cache} (the first start's compile, in the image)")
    done = run_docker(argv, docker=docker, check=False, timeout=7200)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
        raise BuildError(f"warming {image} failed (exit {done.returncode}):\n{tail}")
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        engine = cache / Path(result["engine_dir"]).relative_to(CONTAINER_CACHE)
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise BuildError(f"warming {image}: the runtime's answer was not the expected JSON ({exc!r}): "
                         f"{done.stdout.strip()[-300:]!r}") from None
    return WarmResult(image, result["key"], result["outcome"], result["seconds"], engine)
