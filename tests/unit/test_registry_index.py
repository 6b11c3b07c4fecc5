"""RegistryApi's completeness checks on what a push left in the registry (builder/registry/api.py:
verify, check_complete, config_digests), for single manifests and multi-arch image indexes (an index's
child manifests, and each child's config and layers, must all be present), against an in-memory registry.

InMemoryApi stands in for the registry: it overrides only the two calls that go over HTTP (manifest and
blob_exists) and keeps manifests and blobs in dicts, so the checks run exactly as they do against a real
registry (tests/integration/test_publish.py runs them against one)."""
from __future__ import annotations

import hashlib
import json

import pytest

from builder.errors import PublishError
from builder.registry.api import INDEX_TYPES, MANIFEST_TYPES, Manifest, RegistryApi, config_digests
from builder.registry.reference import Registry

OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST = MANIFEST_TYPES
REPO = "team/embed"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_digest(name: str) -> str:
    return _digest(name.encode())


class InMemoryApi(RegistryApi):
    """Stands in for the registry: manifests by tag or digest and blobs with their sizes, in memory.
    Records what was asked, so a test can see every child and blob was looked at."""

    def __init__(self):
        super().__init__(Registry.parse("127.0.0.1:5000/team"), None, scheme="http")
        self.manifests: dict[str, Manifest] = {}  # digest -> manifest
        self.tags: dict[str, str] = {}  # tag -> digest
        self.blobs: dict[str, int | None] = {}  # digest -> size (None: the registry sends no length)
        self.asked: list[tuple[str, str]] = []  # ("manifest" | "blob", reference)

    def manifest(self, repo: str, reference: str) -> Manifest | None:
        assert repo == REPO
        self.asked.append(("manifest", reference))
        digest = reference if reference.startswith("sha256:") else self.tags.get(reference, "")
        return self.manifests.get(digest)

    def blob_exists(self, repo: str, digest: str) -> tuple[bool, int | None]:
        assert repo == REPO
        self.asked.append(("blob", digest))
        if digest not in self.blobs:
            return False, None
        return True, self.blobs[digest]

    # ---- building what a push leaves
    def store(self, body: dict, tag: str | None = None) -> Manifest:
        raw = json.dumps(body, sort_keys=True).encode()
        m = Manifest(_digest(raw), body.get("mediaType", ""), body, raw)
        self.manifests[m.digest] = m
        if tag:
            self.tags[tag] = m.digest
        return m

    def image(self, arch: str, *, blobs: bool = True, media_type: str = OCI_MANIFEST) -> Manifest:
        """A one-platform image manifest: config + two layers (uploaded unless blobs=False)."""
        config = {"mediaType": "application/vnd.oci.image.config.v1+json", "size": 100 + len(arch),
                  "digest": blob_digest(f"config-{arch}")}
        layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "size": 1000 * (i + 1),
                   "digest": blob_digest(f"layer{i}-{arch}")} for i in range(2)]
        if blobs:
            for desc in (config, *layers):
                self.blobs[desc["digest"]] = desc["size"]
        return self.store({"schemaVersion": 2, "mediaType": media_type, "config": config, "layers": layers})

    def index(self, children: list[Manifest], tag: str | None = None, media_type: str = OCI_INDEX) -> Manifest:
        entries = [{"mediaType": c.media_type, "size": len(c.raw), "digest": c.digest,
                    "platform": {"os": "linux", "architecture": f"arch{i}"}} for i, c in enumerate(children)]
        return self.store({"schemaVersion": 2, "mediaType": media_type, "manifests": entries}, tag)


def child_blobs(m: Manifest) -> list[str]:
    return [m.body["config"]["digest"], *(layer["digest"] for layer in m.body["layers"])]


@pytest.fixture
def api():
    return InMemoryApi()


# --------------------------------------------------------------------------- a complete index passes
@pytest.mark.parametrize("media_type", INDEX_TYPES)
def test_a_complete_multi_arch_index_verifies_and_every_blob_is_looked_at(api, media_type):
    amd, arm = api.image("amd64"), api.image("arm64", media_type=DOCKER_MANIFEST)
    index = api.index([amd, arm], tag="1.0", media_type=media_type)
    assert api.verify(REPO, "1.0", index.digest) is index
    blobs = [ref for kind, ref in api.asked if kind == "blob"]
    assert blobs == child_blobs(amd) + child_blobs(arm)  # every child's config and layers, in order
    assert [ref for kind, ref in api.asked if kind == "manifest"] == ["1.0", amd.digest, arm.digest]


def test_an_index_is_known_by_its_manifests_list_without_a_media_type(api):
    amd = api.image("amd64")
    index = api.store({"schemaVersion": 2, "manifests": [{"digest": amd.digest, "size": len(amd.raw)}]})
    assert index.media_type == ""
    api.check_complete(REPO, index)
    assert [ref for kind, ref in api.asked if kind == "blob"] == child_blobs(amd)
    del api.blobs[child_blobs(amd)[2]]
    with pytest.raises(PublishError, match="is missing"):
        api.check_complete(REPO, index)


@pytest.mark.parametrize("media_type", INDEX_TYPES)
def test_an_index_with_no_children_listed_names_no_blob(api, media_type):
    """An index media type with no manifests key: nothing to look up, and no 'no config' complaint."""
    api.check_complete(REPO, api.store({"schemaVersion": 2, "mediaType": media_type}))
    assert api.asked == []


# --------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("which", [0, 1, 2], ids=["config", "first layer", "last layer"])
@pytest.mark.parametrize("child", [0, 1], ids=["first child", "second child"])
def test_an_index_whose_child_lacks_a_blob_is_refused(api, which, child):
    kids = [api.image("amd64"), api.image("arm64")]
    index = api.index(kids, tag="1.0")
    missing = child_blobs(kids[child])[which]
    del api.blobs[missing]
    with pytest.raises(PublishError) as exc:
        api.verify(REPO, "1.0", index.digest)
    assert str(exc.value) == f"{REPO}: blob {missing} referenced by manifest {kids[child].digest} is missing"


def test_an_index_whose_child_was_pushed_without_its_blobs_is_refused(api):
    index = api.index([api.image("amd64"), api.image("arm64", blobs=False)], tag="1.0")
    with pytest.raises(PublishError, match="referenced by manifest .* is missing"):
        api.verify(REPO, "1.0", index.digest)


def test_an_index_naming_a_missing_child_manifest_is_refused(api):
    amd, arm = api.image("amd64"), api.image("arm64")
    index = api.index([amd, arm], tag="1.0")
    del api.manifests[arm.digest]
    with pytest.raises(PublishError) as exc:
        api.verify(REPO, "1.0", index.digest)
    assert str(exc.value) == f"{REPO}: index {index.digest} references missing manifest {arm.digest}"


def test_a_child_blob_of_another_size_is_refused(api):
    amd, arm = api.image("amd64"), api.image("arm64")
    index = api.index([amd, arm])
    layer = arm.body["layers"][1]
    api.blobs[layer["digest"]] = layer["size"] - 1
    with pytest.raises(PublishError) as exc:
        api.check_complete(REPO, index)
    assert str(exc.value) == (f"{REPO}: blob {layer['digest']} has {layer['size'] - 1} bytes, the manifest says "
                              f"{layer['size']}")


def test_sizes_are_compared_only_when_both_sides_give_one(api):
    amd = api.image("amd64")
    api.blobs[child_blobs(amd)[1]] = None  # the registry sent no Content-Length
    api.check_complete(REPO, amd)
    body = json.loads(amd.raw)
    del body["layers"][0]["size"]  # the manifest gives no size
    api.blobs[child_blobs(amd)[1]] = 5
    api.check_complete(REPO, api.store(body))
    body["config"]["size"] = str(body["config"]["size"])  # a size as a string is compared as a number
    api.check_complete(REPO, api.store(body))


def test_a_manifest_without_a_layers_list_needs_only_its_config(api):
    config = {"mediaType": "application/vnd.oci.image.config.v1+json", "size": 7, "digest": blob_digest("c")}
    m = api.store({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config})
    api.blobs[config["digest"]] = 7
    api.check_complete(REPO, api.index([m]))
    assert [ref for kind, ref in api.asked if kind == "blob"] == [config["digest"]]
    del api.blobs[config["digest"]]
    with pytest.raises(PublishError, match=f"blob {config['digest']} referenced by manifest {m.digest} is missing"):
        api.check_complete(REPO, m)


def test_a_manifest_without_a_config_is_refused(api):
    amd = api.image("amd64")
    body = {k: v for k, v in amd.body.items() if k != "config"}
    child = api.store(body)
    index = api.index([child])
    with pytest.raises(PublishError) as exc:
        api.check_complete(REPO, index)
    assert str(exc.value) == f"{REPO}: manifest {child.digest} has no config (schema 1?)"
    with pytest.raises(PublishError, match="has no config"):
        api.check_complete(REPO, api.store({**body, "config": {}}))


@pytest.mark.parametrize("digest, shown", [
    ("sha512:" + "a" * 128, "'sha512:" + "a" * 128 + "'"),
    ("sha256:" + "A" * 64, "'sha256:" + "A" * 64 + "'"),
    ("sha256:" + "a" * 63, "'sha256:" + "a" * 63 + "'"),
    ("sha256:" + "a" * 65, "'sha256:" + "a" * 65 + "'"),
    ("xsha256:" + "a" * 64, "'xsha256:" + "a" * 64 + "'"),
    (None, "''"),
])
def test_a_child_naming_a_malformed_digest_is_refused(api, digest, shown):
    amd = api.image("amd64")
    body = json.loads(amd.raw)
    if digest is None:
        del body["layers"][1]["digest"]
    else:
        body["layers"][1]["digest"] = digest
        api.blobs[digest] = body["layers"][1]["size"]  # present, yet its name is not a digest we accept
    child = api.store(body)
    with pytest.raises(PublishError) as exc:
        api.check_complete(REPO, api.index([child]))
    assert str(exc.value) == f"{REPO}: manifest {child.digest} references an unsupported digest {shown}"


def test_indexes_nest_three_deep_at_most(api):
    leaf = api.image("amd64")
    level3 = api.index([leaf])
    level2 = api.index([level3])
    level1 = api.index([level2])
    api.check_complete(REPO, level1)  # index -> index -> index -> manifest
    assert [ref for kind, ref in api.asked if kind == "blob"] == child_blobs(leaf)
    level0 = api.index([level1])
    with pytest.raises(PublishError) as exc:
        api.check_complete(REPO, level0)
    assert str(exc.value) == f"manifest {level3.digest} nests indexes too deeply"
    # The depth counts from where the check starts.
    with pytest.raises(PublishError, match="nests indexes too deeply"):
        api.check_complete(REPO, level1, depth=1)


# --------------------------------------------------------------------------- verify: the tag first
def test_verify_refuses_a_missing_tag_and_a_tag_at_another_digest(api):
    amd, arm = api.image("amd64"), api.image("arm64")
    index = api.index([amd, arm], tag="1.0")
    with pytest.raises(PublishError) as exc:
        api.verify(REPO, "2.0", index.digest)
    assert str(exc.value) == f"127.0.0.1:5000/{REPO}:2.0 is missing from the registry right after the push"
    api.tags["1.0"] = amd.digest
    with pytest.raises(PublishError) as exc:
        api.verify(REPO, "1.0", index.digest)
    assert str(exc.value) == f"127.0.0.1:5000/{REPO}:1.0 points at {amd.digest}, expected {index.digest}"


def test_verify_checks_the_manifest_it_finds(api):
    amd = api.image("amd64")
    api.tags["1.0"] = amd.digest
    assert api.verify(REPO, "1.0", amd.digest) is amd
    del api.blobs[child_blobs(amd)[0]]
    with pytest.raises(PublishError, match=f"blob {child_blobs(amd)[0]} referenced by manifest"):
        api.verify(REPO, "1.0", amd.digest)


# --------------------------------------------------------------------------- config_digests
def test_config_digests_of_an_index_are_every_childs_config(api):
    amd, arm = api.image("amd64"), api.image("arm64")
    assert config_digests(api, REPO, amd) == {amd.body["config"]["digest"]}
    index = api.index([amd, arm])
    assert config_digests(api, REPO, index) == {amd.body["config"]["digest"], arm.body["config"]["digest"]}
    # Known by its manifests list alone; nested; a child that is gone names nothing.
    bare = api.store({"manifests": [{"digest": arm.digest}]})
    assert config_digests(api, REPO, bare) == {arm.body["config"]["digest"]}
    nested = api.index([index, api.image("s390x")])
    assert config_digests(api, REPO, nested) == {amd.body["config"]["digest"], arm.body["config"]["digest"],
                                                 blob_digest("config-s390x")}
    del api.manifests[arm.digest]
    assert config_digests(api, REPO, index) == {amd.body["config"]["digest"]}
    assert config_digests(api, REPO, api.store({"mediaType": DOCKER_LIST})) == set()


def test_config_digests_of_a_manifest_without_a_config_is_empty(api):
    assert config_digests(api, REPO, api.store({"mediaType": OCI_MANIFEST, "layers": []})) == set()
    assert config_digests(api, REPO, api.store({"mediaType": OCI_MANIFEST, "config": {}})) == set()
    assert config_digests(api, REPO, api.store({"mediaType": OCI_MANIFEST, "config": {"digest": ""}})) == set()
