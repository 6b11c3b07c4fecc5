"""A CycloneDX 1.5 SBOM from the image's own package records: dpkg's database and the Python
distributions' metadata, read by running the image (no network). Debian packages get the purl of the
distribution the image is built on (pkg:deb/ubuntu/... on Ubuntu bases, with its distro qualifier),
read from /etc/os-release. The document is built and written by cyclonedx-python-lib (its model and its
JSON outputter for spec 1.5); purls by packageurl-python."""
from __future__ import annotations

import json
import re
import shlex
import uuid

from cyclonedx.model import Property
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.model.tool import Tool
from cyclonedx.output.json import JsonV1Dot5
from packageurl import PackageURL

from .. import __version__
from ..dockerclient import DockerCli, run_docker
from ..errors import BuildError

_SEPARATOR = "---mopt-sbom---"
_LIST_DISTRIBUTIONS = """
import importlib.metadata, json
seen = {}
for d in importlib.metadata.distributions():
    seen.setdefault(d.metadata["Name"], d.version)
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


def _deb_purl(name: str, version: str, arch: str, release: dict[str, str]) -> PackageURL:
    distro = (release.get("ID") or "debian").lower()
    qualifiers = {"arch": arch}
    if release.get("VERSION_ID"):
        qualifiers["distro"] = f"{distro}-{release['VERSION_ID']}"
    return PackageURL(type="deb", namespace=distro, name=name, version=version, qualifiers=qualifiers)


def _pypi_purl(name: str, version: str) -> PackageURL:
    """PEP 503 normalisation: lowercase, each run of -, _ and . one -."""
    return PackageURL(type="pypi", name=re.sub(r"[-_.]+", "-", name).lower(), version=version)


def deb_purl(name: str, version: str, arch: str, release: dict[str, str]) -> str:
    return _deb_purl(name, version, arch, release).to_string()


def pypi_purl(name: str, version: str) -> str:
    return _pypi_purl(name, version).to_string()


def document(reference: str, image_id: str, release: dict[str, str], debs: list[tuple[str, str, str]],
             pips: list[dict], note: str = "") -> dict:
    """The SBOM as a dict (cyclonedx-python-lib's JSON for spec 1.5). The same input gives the same
    document: the serial number is a UUID5 of the reference and image id, and there is no timestamp.
    bom-refs are unique, as the library requires (it would rename a repeat at random): a Debian package
    whose name repeats (multiarch) gets deb:<name>:<arch>; a Python distribution whose normalised name
    repeats (another site dir) is the one listed first (first on sys.path, the one imported)."""
    components: dict[str, Component] = {}
    for name, version, arch in sorted(set(debs)):
        ref = f"deb:{name}" if f"deb:{name}" not in components else f"deb:{name}:{arch}"
        components.setdefault(ref, Component(type=ComponentType.LIBRARY, name=name, version=version, bom_ref=ref,
                                             purl=_deb_purl(name, version, arch, release)))
    for p in pips:
        purl = _pypi_purl(p["name"], p["version"])
        ref = f"pypi:{p['name'].lower()}"
        components.setdefault(f"pypi:{purl.name}", Component(type=ComponentType.LIBRARY, name=p["name"],
                                                             version=p["version"], bom_ref=ref, purl=purl))
    root = Component(type=ComponentType.CONTAINER, name=reference, version=image_id, bom_ref=image_id)
    bom = Bom(serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"mopt-sbom:{reference}\n{image_id}"),
              components=components.values())
    bom.metadata.timestamp = None
    bom.metadata.component = root
    bom.metadata.tools.tools.add(Tool(vendor="mopt", name="mopt", version=__version__))
    if note:
        bom.metadata.properties.add(Property(name="mopt:note", value=note))
    bom.register_dependency(root, components.values())
    doc = json.loads(JsonV1Dot5(bom).output_as_string())
    doc.setdefault("components", [])  # the library leaves an empty list out; readers look for it
    return doc


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
