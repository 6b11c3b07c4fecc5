"""The image SBOM (builder/attest/sbom.py) against CycloneDX's own JSON schema, through cyclonedx-python-lib's
strict validator, and its purls read back by packageurl-python."""
from __future__ import annotations

import json

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator
from packageurl import PackageURL

from builder.attest.sbom import document

DIGEST = "sha256:" + "ab" * 32
REFERENCE = f"127.0.0.1:5000/mopt/minilm-embed@{DIGEST}"
DEBIAN = {"ID": "debian", "VERSION_ID": "12", "NAME": "Debian GNU/Linux"}
DEBS = [("util-linux", "1:2.38-2", "amd64"), ("python3.11", "3.11.2-6+deb12u6", "amd64"),
        ("tzdata", "2024a-0+deb12u1", "all"), ("libstdc++6", "12.2.0-14", "amd64")]
PIPS = [{"name": "Jinja2", "version": "3.1.4"}, {"name": "typing_extensions", "version": "4.12.2"},
        {"name": "zope.interface", "version": "7.0.3"}, {"name": "torch", "version": "2.13.0+cpu"}]


def errors(doc: dict):
    return JsonStrictValidator(SchemaVersion.V1_5).validate_str(json.dumps(doc))


def realistic() -> dict:
    return document(REFERENCE, DIGEST, DEBIAN, DEBS, PIPS, note="built by a test")


def test_a_realistic_document_is_valid_cyclonedx_1_5():
    doc = realistic()
    assert errors(doc) is None
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.5" and doc["version"] == 1
    assert doc["metadata"]["component"] == {"type": "container", "name": REFERENCE, "version": DIGEST,
                                            "bom-ref": DIGEST}
    assert doc["metadata"]["tools"][0]["name"] == "mopt" and doc["metadata"]["tools"][0]["version"]
    assert {c["bom-ref"] for c in doc["components"]} == {
        "deb:util-linux", "deb:python3.11", "deb:tzdata", "deb:libstdc++6",
        "pypi:jinja2", "pypi:typing_extensions", "pypi:zope.interface", "pypi:torch"}


def test_the_note_is_a_property():
    assert realistic()["metadata"]["properties"] == [{"name": "mopt:note", "value": "built by a test"}]
    assert "properties" not in document(REFERENCE, DIGEST, DEBIAN, DEBS, PIPS)["metadata"]


@pytest.mark.parametrize(("ref", "expected"), [
    ("deb:util-linux", ("deb", "debian", "util-linux", "1:2.38-2", {"arch": "amd64", "distro": "debian-12"})),
    ("deb:python3.11", ("deb", "debian", "python3.11", "3.11.2-6+deb12u6",
                        {"arch": "amd64", "distro": "debian-12"})),
    ("deb:tzdata", ("deb", "debian", "tzdata", "2024a-0+deb12u1", {"arch": "all", "distro": "debian-12"})),
    ("deb:libstdc++6", ("deb", "debian", "libstdc++6", "12.2.0-14", {"arch": "amd64", "distro": "debian-12"})),
    ("pypi:jinja2", ("pypi", None, "jinja2", "3.1.4", {})),
    ("pypi:typing_extensions", ("pypi", None, "typing-extensions", "4.12.2", {})),
    ("pypi:zope.interface", ("pypi", None, "zope-interface", "7.0.3", {})),
    ("pypi:torch", ("pypi", None, "torch", "2.13.0+cpu", {})),
])
def test_purls_parse_back(ref, expected):
    component = next(c for c in realistic()["components"] if c["bom-ref"] == ref)
    purl = PackageURL.from_string(component["purl"])
    assert (purl.type, purl.namespace, purl.name, purl.version, purl.qualifiers or {}) == expected


def test_ubuntu_bases_get_ubuntu_purls_and_no_distro_without_a_version():
    ubuntu = document(REFERENCE, DIGEST, {"ID": "ubuntu", "VERSION_ID": "22.04"}, [("libc6", "2.35", "amd64")], [])
    assert ubuntu["components"][0]["purl"] == "pkg:deb/ubuntu/libc6@2.35?arch=amd64&distro=ubuntu-22.04"
    bare = document(REFERENCE, DIGEST, {}, [("libc6", "2.35", "amd64")], [])
    assert bare["components"][0]["purl"] == "pkg:deb/debian/libc6@2.35?arch=amd64"
    assert errors(ubuntu) is None and errors(bare) is None


def test_the_same_input_gives_the_same_document():
    one, two = realistic(), document(REFERENCE, DIGEST, DEBIAN, list(reversed(DEBS)), PIPS, note="built by a test")
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)
    assert "timestamp" not in one["metadata"] and one["serialNumber"].startswith("urn:uuid:")
    assert document(REFERENCE, "sha256:" + "cd" * 32, DEBIAN, DEBS, PIPS)["serialNumber"] != one["serialNumber"]


def test_repeated_packages_keep_unique_bom_refs():
    """A distribution in two site dirs (first listed wins) and a multiarch deb: no duplicate bom-ref, no
    library-made random one, still valid."""
    pips = [{"name": "Jinja2", "version": "3.1.4"}, {"name": "jinja2", "version": "3.0.0"},
            {"name": "typing_extensions", "version": "4.12.2"}, {"name": "typing-extensions", "version": "4.0.0"}]
    debs = [("libc6", "2.36-9", "amd64"), ("libc6", "2.36-9", "i386"), ("libc6", "2.36-9", "amd64")]
    doc = document(REFERENCE, DIGEST, DEBIAN, debs, pips)
    refs = {c["bom-ref"]: c for c in doc["components"]}
    assert sorted(refs) == ["deb:libc6", "deb:libc6:i386", "pypi:jinja2", "pypi:typing_extensions"]
    assert refs["pypi:jinja2"]["version"] == "3.1.4" and refs["pypi:typing_extensions"]["version"] == "4.12.2"
    assert errors(doc) is None and doc == document(REFERENCE, DIGEST, DEBIAN, debs, pips)


def test_an_image_without_packages_has_an_empty_components_list():
    doc = document(REFERENCE, DIGEST, {}, [], [], note="no shell in the image: no package records read")
    assert doc["components"] == [] and errors(doc) is None


@pytest.mark.parametrize("breakage", ["component without name", "bad component type", "unknown field",
                                      "bad serial number"])
def test_the_validator_refuses_a_broken_document(breakage):
    doc = realistic()
    if breakage == "component without name":
        del doc["components"][0]["name"]
    elif breakage == "bad component type":
        doc["components"][0]["type"] = "gadget"
    elif breakage == "unknown field":
        doc["components"][0]["colour"] = "blue"
    else:
        doc["serialNumber"] = "not-a-uuid"
    assert errors(doc) is not None
