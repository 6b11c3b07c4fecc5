"""A CycloneDX 1.5 SBOM from the image's own package records: dpkg's database and the Python
distributions' metadata, read by running the image (no network). Debian packages get the purl of the
distribution the image is built on (pkg:deb/ubuntu/... on Ubuntu bases, with its distro qualifier),
read from /etc/os-release."""
from __future__ import annotations

import json
import shlex
from urllib.parse import quote

from .. import __version__
from ..dockerclient import DockerCli, run_docker
from ..errors import BuildError

_SEPARATOR = "---mopt-sbom---"
_LIST_DISTRIBUTIONS = """
import importlib.metadata, json
seen = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
print(json.dumps([{"name": n, "version": v} for n, v in seen.items()]))
"""
_SCRIPT = (f"cat /etc/os-release 2>/dev/null; echo {_SEPARATOR}; "
           "dpkg-query -W -f '${Package}\\t${Version}\\t${Architecture}\\n' 2>/dev/null; "
           f"echo {_SEPARATOR}; python -c {shlex.quote(_LIST_DISTRIBUTIONS)} 2>/dev/null || echo '[]'")


def os_release(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out


def deb_purl(name: str, version: str, arch: str, release: dict[str, str]) -> str:
    distro = (release.get("ID") or "debian").lower()
    purl = f"pkg:deb/{quote(distro)}/{quote(name)}@{quote(version, safe='.-_~')}?arch={quote(arch)}"
    if release.get("VERSION_ID"):
        purl += f"&distro={quote(distro)}-{quote(release['VERSION_ID'], safe='.')}"
    return purl


def pypi_purl(name: str, version: str) -> str:
    normalized = name.lower().replace("_", "-").replace(".", "-")
    return f"pkg:pypi/{quote(normalized)}@{quote(version, safe='.-_~')}"


def document(reference: str, image_id: str, release: dict[str, str], debs: list[tuple[str, str, str]],
             pips: list[dict], note: str = "") -> dict:
    components = [{"type": "library", "name": name, "version": version, "purl": deb_purl(name, version, arch, release),
                   "bom-ref": f"deb:{name}"} for name, version, arch in sorted(debs)]
    components += [{"type": "library", "name": p["name"], "version": p["version"],
                    "purl": pypi_purl(p["name"], p["version"]), "bom-ref": f"pypi:{p['name'].lower()}"}
                   for p in sorted(pips, key=lambda p: p["name"].lower())]
    metadata = {"tools": [{"vendor": "mopt", "name": "mopt", "version": __version__}],
                "component": {"type": "container", "name": reference, "version": image_id, "bom-ref": image_id}}
    if note:
        metadata["properties"] = [{"name": "mopt:note", "value": note}]
    return {"bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1, "metadata": metadata,
            "components": components}


def sbom(docker: DockerCli, image_id: str, reference: str) -> dict:
    """The image's SBOM. An image without a shell (no package records to read) gets an SBOM without
    components that says so; any other failure to run it is a BuildError."""
    res = run_docker(["run", "--rm", "--network", "none", "--entrypoint", "sh", image_id, "-c", _SCRIPT],
                     docker=docker, timeout=300, check=False)
    if res.returncode != 0:
        if "executable file not found" in res.stderr or "no such file or directory" in res.stderr.lower():
            return document(reference, image_id, {}, [], [], note="no shell in the image: no package records read")
        raise BuildError(f"reading the package records of {image_id[:19]} failed: {res.stderr.strip()[-300:]}")
    parts = res.stdout.split(_SEPARATOR + "\n")
    if len(parts) != 3:
        raise BuildError(f"reading the package records of {image_id[:19]}: unexpected output")
    release = os_release(parts[0])
    debs = [tuple(line.split("\t")) for line in parts[1].strip().splitlines() if line.count("\t") == 2]
    try:
        pips = json.loads(parts[2].strip().splitlines()[-1])
    except (ValueError, IndexError):
        pips = []
    return document(reference, image_id, release, debs, pips)
