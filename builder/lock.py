"""mopt lock: pin what a runtime image is made of, so the same image can be built months later.

Per runtime (one entry per distinct Dockerfile.base + Dockerfile.runtime [+ Dockerfile.toolchain], the "lock
key"; read from the toolchain image where there is one: it holds what the serving-only runtime leaves out):
  base      the base image by id (and the rootfs sha256 for rootfs bases, the repo digest otherwise)
  python    every installed distribution as `name==version --hash=sha256:...`, the hashes of the
            exact wheels pip would fetch (the wheelhouse's for the local torch)
  debian    every installed Debian package as name=version
Per hf:// or modelscope:// model (keyed by the recipe's source): the commit its revision named and each file's sha256.
`mopt build --locked` installs with `pip install --require-hashes` from the lock and apt
`name=version`, and fails clearly when a variant's lock key is not in the lock (stale lock).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .dockerclient import DockerCli, run_docker
from .errors import BuildError, ConfigError, EnvironmentProblem, MoptError
from .hashing import dump_json, sha256_text
from .plan import Variant
from .yamlio import parse_json_bounded

LOCK_FILE = "mopt.lock.json"
Log = Callable[[str], None]

# Runs inside a container of the runtime image: freeze, fetch the exact wheels, hash them.
_PYTHON_SCRIPT = r"""
set -eu
if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi
python -m pip freeze --all --disable-pip-version-check | grep -v '^-e ' > /tmp/frozen.txt
python -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
    --find-links /wheelhouse -d /tmp/w -r /tmp/frozen.txt >&2
python - <<'PY'
import hashlib, json, pathlib, re
frozen = {}
for line in open("/tmp/frozen.txt"):
    name, _, version = line.strip().partition("==")
    frozen[re.sub(r"[-_.]+", "-", name).lower()] = (name, version)
out, seen = [], set()
for wheel in sorted(pathlib.Path("/tmp/w").iterdir()):
    dist = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    seen.add(dist)
    name, version = frozen[dist]
    out.append(f"{name}=={version} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}")
missing = sorted(set(frozen) - seen)
print(json.dumps({"python": out, "missing": missing}))
PY
"""


LOCKED_DOCKERFILES = ("Dockerfile.base", "Dockerfile.runtime", "Dockerfile.toolchain")


def lock_key(render_dir: Path) -> str:
    """What decides a runtime's dependencies: its rendered Dockerfiles, the toolchain's where it has one (not
    mopt's own runtime code)."""
    return sha256_text(*((render_dir / name).read_text() for name in LOCKED_DOCKERFILES
                         if name != "Dockerfile.toolchain" or (render_dir / name).is_file()))


def read_lock(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no lock file (run mopt lock first)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    data = parse_json_bounded(text, str(path))
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("runtimes"), dict):
        raise ConfigError(f"{path}: not a mopt lock (schema 1)")
    return data


def lock_entry(lock: dict, lock_path: Path, variant: Variant, render_dir: Path) -> dict:
    key = lock_key(render_dir)
    entry = lock["runtimes"].get(key)
    if entry is None:
        raise ConfigError(f"{lock_path} is stale for {variant.id}: its base or runtime Dockerfile changed since "
                          f"mopt lock (lock key {key[:12]} not in the lock); run mopt lock --select '{variant.id}'")
    if entry.get("missing"):
        raise ConfigError(f"{lock_path} pins {variant.id} only partly (locked where its runtime could not be "
                          f"built; missing: {'; '.join(entry['missing'])}); run mopt lock --select '{variant.id}' "
                          "on a host that can build it")
    return entry


def partial_entry(variant: Variant, base: dict, why: str) -> dict:
    """What can be pinned without the runtime image: the versions the plan resolved and the base reference;
    `missing` says what is not pinned and why. A locked build refuses it (lock_entry)."""
    resolved = variant.resolved.to_json()
    pins = {name: resolved[name] for name in ("python", "cuda", "torch", "tensorrt", "tensorrt_llm", "vllm")
            if resolved[name]}
    missing = ["the Python packages' hashes and the Debian package versions: the runtime image was not built "
               f"here ({why})"]
    if base.get("kind") == "image" and not base.get("image_id"):
        missing.append(f"the digest of base {base['ref']}: not present here")
    return {"variants": [variant.id], "base": base, "pins": pins, "python": [], "debian": [], "missing": missing}


def lock_runtime(docker: DockerCli, runtime_image: str, wheelhouse: list[Path], ca_bundle: Path | None) -> dict:
    mounts = []
    for wheel in wheelhouse:
        mounts += ["-v", f"{wheel}:/wheelhouse/{wheel.name}:ro"]
    if ca_bundle:
        mounts += ["-v", f"{ca_bundle}:/run/secrets/ca:ro"]  # a run-time mount: never in an image layer
    result = run_docker(["run", "--rm", "--user", "0", *mounts, "--entrypoint", "sh", runtime_image, "-c",
                         _PYTHON_SCRIPT], docker=docker, check=False, timeout=1800)
    if result.returncode != 0:
        raise BuildError(f"locking the Python packages of {runtime_image[:19]} failed: "
                         f"{(result.stderr or result.stdout).strip()[-600:]}")
    python = json.loads(result.stdout.strip().splitlines()[-1])
    if python["missing"]:
        raise BuildError(f"no wheel found to hash for: {', '.join(python['missing'])}")
    debian = run_docker(["run", "--rm", "--network", "none", "--entrypoint", "dpkg-query", runtime_image, "-W",
                         "-f", "${Package}=${Version}\n"], docker=docker).stdout.split()
    return {"python": python["python"], "debian": sorted(debian)}


def write_lock(path: Path, entries: dict, previous: dict | None, models: dict | None = None,
               current: frozenset[str] | None = None) -> dict:
    """Merge ENTRIES into the lock; a partial entry never replaces a complete one (locked on a host that
    could build that runtime). CURRENT: the keys the matrix renders now; a previous entry under any other
    key pins a runtime no variant builds any more (a changed template or pin) and is dropped."""
    runtimes = {key: entry for key, entry in (previous or {}).get("runtimes", {}).items()
                if current is None or key in current}
    for key, entry in entries.items():
        if entry.get("missing") and key in runtimes and not runtimes[key].get("missing"):
            continue
        runtimes[key] = entry
    pinned = dict((previous or {}).get("models", {}))
    pinned.update(models or {})
    data = {"schema": 1, "runtimes": runtimes} | ({"models": pinned} if pinned else {})
    path.write_text(dump_json(data))
    return runtimes


def lock_model(recipe, cache: Path, log: Log) -> tuple[str, dict] | None:
    """A hub model's pin: (recipe source, {repo, revision, sha, files: path -> sha256}), fetched or cached.
    None for the other sources (local: and package: are digested into the record, generate: is code)."""
    from .hubs import fetch, hub_for
    from .models import HUB_KINDS

    if recipe.model.kind not in HUB_KINDS:
        return None
    snapshot = fetch(hub_for(recipe.model.kind), recipe.model.ref, cache, log)
    return recipe.model.text, snapshot.lock_entry()


def requirements_text(entry: dict) -> str:
    return "".join(line + "\n" for line in entry["python"])


def make_lock(builder, variants, path: Path, log: Log = print) -> dict:
    """Lock every selected variant's runtime and merge the entries into the lock file. Each runtime is
    built up to its runtime stage by BUILDER (a build.Builder; no engine compile: that needs the target
    GPU) and read; one that cannot be built here (a base no registry here serves, an index out of reach)
    gets a partial entry that says what is missing. Returns the entries written."""
    from .base import load_base

    matrix, options = builder.matrix, builder.options
    state = options.state
    wheels = [p for d in options.find_links for p in sorted(d.iterdir()) if p.suffix == ".whl"]
    previous = read_lock(path) if path.is_file() else None
    entries: dict = {}
    models: dict = {}
    for variant in variants:
        _, render_dir = builder.render(variant)
        key = lock_key(render_dir)
        if key in entries:
            entries[key]["variants"].append(variant.id)
            continue
        spec = matrix.bases[variant.resolved.base.name]
        base: dict = {"name": spec.name, "kind": spec.kind, "ref": variant.resolved.base.ref}
        try:
            made = builder.runtime(variant)
            if spec.kind == "rootfs":
                rootfs = load_base(state.bases, spec.image)
                base["rootfs_sha256"] = rootfs.rootfs_sha256 if rootfs else ""
            else:
                info = json.loads(run_docker(["image", "inspect", made.base_ref], docker=builder.docker).stdout)[0]
                base["image_id"], base["repo_digests"] = info["Id"], info.get("RepoDigests", [])
            # A serving-only runtime leaves out what its toolchain stage installs again: the toolchain holds
            # both sets (and the compiler's Debian packages), so one entry pins both stages.
            read = builder.compiler(variant, made)
            log(f"locking {variant.id} ({read.name} {read.image_id[:19]})")
            entries[key] = {"variants": [variant.id], "base": base,
                            **lock_runtime(builder.docker, read.image_id, wheels, options.ca_bundle)}
        except (BuildError, EnvironmentProblem) as exc:
            why = exc.message.splitlines()[0].removeprefix(f"{variant.id}: ")
            log(f"locking {variant.id} partly: {why}")
            entries[key] = partial_entry(variant, base, why)
    for image in dict.fromkeys(v.image for v in variants):  # each recipe's hub model once
        if options.models == "substitute":
            break
        try:
            pin = lock_model(matrix.image(image).recipe, state.models, log)
        except MoptError as exc:  # the hub out of reach, and no cached commit: the lock says so
            log(f"note: {image}'s model is not pinned: {exc.message.splitlines()[0]}")
            continue
        if pin is not None:
            models[pin[0]] = pin[1]
    current = frozenset(entries) | {lock_key(builder.render(v)[1]) for v in builder.all_variants
                                    if v not in variants}
    stale = sorted(set((previous or {}).get("runtimes", {})) - current)
    if stale:
        log(f"dropped {len(stale)} stale runtimes (no variant of the matrix renders them now): "
            + ", ".join(key[:12] for key in stale))
    written = write_lock(path, entries, previous, models, current)
    return {key: written[key] for key in entries}
