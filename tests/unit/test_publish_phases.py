"""builder.registry.phases: the release phases against a fake docker CLI, a fake copy by image id and an
in-memory registry (no Docker, no skopeo, no HTTP).

The order is the contract: every long (immutable) tag is checked (phase 0), pushed by image id and
verified, its config the tested image (phase 1), before any short (moving) tag moves to exactly the
verified manifest (phase 2); a failure before phase 2 moves no short tag.
"""
from __future__ import annotations

import base64
import hashlib
import json
import subprocess

import pytest

from builder.dockerclient import DockerCli
from builder.errors import PublishError
from builder.registry import phases, push
from builder.registry.api import Manifest
from builder.registry.credentials import Credentials
from builder.registry.phases import LongTagRecord, PublishItem, PublishResult, Refs
from builder.registry.reference import Registry

HOST = "127.0.0.1:5000"
REGISTRY = Registry.parse(f"{HOST}/team")  # the namespace replaces the planned "mopt"
CLI = DockerCli("/fake/docker", "27.0.0", "buildx", "27.0.0")
MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX = "application/vnd.oci.image.index.v1+json"
REFUSAL_TAIL = ("long tags are immutable and will not be moved (bump the version, or delete the tag from the "
                "registry deliberately)")


def _sha(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class FakeRegistry:
    """What publish asks a registry: manifests by tag or digest, and verify (tag -> digest, blobs present)."""

    def __init__(self, events: list):
        self.events = events
        self.manifests: dict[tuple[str, str], Manifest] = {}
        self.tags: dict[tuple[str, str], str] = {}
        self.blobs: set[tuple[str, str]] = set()
        self.failing: set[tuple[str, str]] = set()  # (repo, reference) whose GET keeps failing
        self.after_verify: dict[tuple[str, str], object] = {}  # (repo, tag) -> hook (another publisher)
        self.after_put: dict[tuple[str, str], object] = {}  # (repo, tag) -> hook, after a short tag moved
        self.closed = False

    def store(self, repo: str, body: dict, *, blobs: bool = True) -> str:
        digest = _sha(json.dumps(body, sort_keys=True))
        self.manifests[(repo, digest)] = Manifest(digest, body["mediaType"], body)
        if blobs:
            self.blobs |= {(repo, d["digest"]) for d in [body.get("config"), *body.get("layers", [])] if d}
        return digest

    def put(self, repo: str, tag: str, body: dict, *, blobs: bool = True) -> str:
        digest = self.store(repo, body, blobs=blobs)
        self.tags[(repo, tag)] = digest
        return digest

    def digest(self, repo: str, tag: str) -> str | None:
        return self.tags.get((repo, tag))

    def manifest(self, repo: str, reference: str) -> Manifest | None:
        self.events.append(("manifest", f"{repo}:{reference}"))
        if (repo, reference) in self.failing:
            raise PublishError(f"registry {HOST} kept failing: HTTP 503 (after 5 attempts)")
        digest = reference if reference.startswith("sha256:") else self.tags.get((repo, reference))
        return self.manifests.get((repo, digest)) if digest else None

    def verify(self, repo: str, tag: str, expected: str) -> Manifest:
        self.events.append(("verify", f"{repo}:{tag}", expected))
        m = self.manifests.get((repo, self.tags.get((repo, tag), "")))
        if m is None:
            raise PublishError(f"{HOST}/{repo}:{tag} is missing from the registry right after the push")
        if m.digest != expected:
            raise PublishError(f"{HOST}/{repo}:{tag} points at {m.digest}, expected {expected}")
        self.check_complete(repo, m)
        hook = self.after_verify.pop((repo, tag), None)
        if hook:
            hook()
        return m

    def check_complete(self, repo: str, m: Manifest) -> None:
        children = [self.manifests[(repo, c["digest"])] for c in m.body.get("manifests", [])]
        for one in children if "manifests" in m.body else [m]:
            for desc in [one.body["config"], *one.body["layers"]]:
                if (repo, desc["digest"]) not in self.blobs:
                    raise PublishError(f"{repo}: blob {desc['digest']} referenced by manifest {one.digest} is missing")

    def put_manifest(self, repo: str, tag: str, m: Manifest) -> str:
        self.events.append(("move", f"{repo}:{tag}"))
        self.tags[(repo, tag)] = m.digest
        hook = self.after_put.pop((repo, tag), None)
        if hook:
            hook()
        return m.digest

    insecure = True

    def close(self) -> None:
        self.closed = True


class FakeDocker:
    """Stands in for builder.registry.push.run_docker: image inspect (tag and rmi are recorded: publish must
    not call them); the images it knows are what fake_copy pushes into FakeRegistry."""

    def __init__(self, registry: FakeRegistry, events: list):
        self.registry, self.events = registry, events
        self.images: dict[str, dict] = {}  # id -> {"Id", "RepoDigests", "layer"}
        self.refs: dict[str, str] = {}  # local tag -> id
        self.push_outputs: dict[str, list[str]] = {}  # ref -> reasons of failing copies, in order
        self.push_as: dict[str, str] = {}  # ref -> the image id a broken copy really sends
        self.lossy: set[str] = set()  # image ids whose layer never reaches the registry
        self.pushes: list[tuple[str, object, list[str]]] = []  # (ref, config_dir, redact)

    def add_image(self, name: str) -> str:
        image_id = _sha(f"config of {name}")
        self.images[image_id] = {"Id": image_id, "RepoDigests": [], "layer": _sha(f"layer of {name}")}
        self.refs[name] = image_id
        return image_id

    def body(self, image_id: str, **extra) -> dict:
        return {"schemaVersion": 2, "mediaType": MANIFEST,
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": image_id,
                           "size": 100},
                "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                            "digest": self.images[image_id]["layer"], "size": 200}], **extra}

    def resolve(self, ref: str) -> str | None:
        if ref in self.images or ref in self.refs:
            return self.refs.get(ref, ref)
        if ref.startswith("sha256:"):
            found = [i for i in self.images if i.startswith(ref)]
            return found[0] if len(found) == 1 else None
        return None

    def __call__(self, args, *, docker=None, log=None, check=True, env=None, timeout=None, redact=(),
                 error_cls=None, **_):
        assert docker is CLI
        args = [str(a) for a in args]
        if args[:2] == ["image", "inspect"]:
            image_id = self.resolve(args[-1])
            if image_id is None:
                return subprocess.CompletedProcess(args, 1, "", f"Error: No such image: {args[-1]}\n")
            img = self.images[image_id]
            out = json.dumps({"Id": image_id, "RepoDigests": list(img["RepoDigests"])}) + "\n"
            return subprocess.CompletedProcess(args, 0, out, "")
        if args[0] == "tag":
            assert args[1] in self.images, f"docker tag of an unknown image {args[1]}"
            self.events.append(("tag", args[2]))
            self.refs[args[2]] = args[1]
            return subprocess.CompletedProcess(args, 0, "", "")
        if args[0] == "rmi":
            self.events.append(("rmi", args[-1]))
            del self.refs[args[-1]]
            return subprocess.CompletedProcess(args, 0, f"Untagged: {args[-1]}\n", "")
        raise AssertionError(f"publish ran docker {args[0]}: images go by id, through copy_image")


def fake_copy(world: World):
    """Stands in for push.copy_image: the image BY ID into the registry (push_as: what a broken copy sends
    instead; push_outputs: failures of the copy, in order)."""
    docker = world.docker

    def copy(image_id, ref, config_dir, *, insecure, log, redact=()):
        world.events.append(("push", ref))
        docker.pushes.append((ref, config_dir, list(redact)))
        if docker.push_outputs.get(ref):
            raise PublishError(f"copying image {image_id[:19]} to {ref} failed: {docker.push_outputs[ref].pop(0)}")
        sent = docker.push_as.get(ref, image_id)
        name, tag = ref.rsplit(":", 1)
        digest = world.registry.put(name.split("/", 1)[1], tag, docker.body(sent), blobs=sent not in docker.lossy)
        log(f"    pushed {ref} from image {image_id[:19]}: {digest}")
        return digest
    return copy


class World:
    def __init__(self, monkeypatch):
        self.events: list = []
        self.registry = FakeRegistry(self.events)
        self.docker = FakeDocker(self.registry, self.events)
        self.api_args: list = []
        self.log: list[str] = []
        monkeypatch.setattr(push, "run_docker", self.docker)
        monkeypatch.setattr(phases, "copy_image", fake_copy(self))
        monkeypatch.setattr(phases, "RegistryApi", self._api)
        monkeypatch.setattr(phases, "find_docker", self._no_docker_lookup)

    def _api(self, registry, credentials, *, config_dir=None, scheme=None):
        self.api_args.append((registry, credentials, config_dir, scheme))
        return self.registry

    @staticmethod
    def _no_docker_lookup():
        raise AssertionError("publish looked for a docker CLI although one was passed")

    def item(self, image: str, *, repository: str | None = None, long_tag: str = "1.0.0-cpu-abc123",
             short_tag: str = "1.0-cpu", image_id: str | None = None) -> PublishItem:
        name = f"mopt/{image}:cpu"
        found = self.docker.resolve(name) or self.docker.add_image(name)
        return PublishItem(f"{image}:cpu", image_id or found, repository or f"mopt/{image}", long_tag, short_tag)

    def publish(self, items, tmp_path, **kw) -> list[PublishResult]:
        kw.setdefault("docker", CLI)
        return phases.publish(items, REGISTRY, docker_config=str(tmp_path), log=self.log.append, **kw)

    def moves(self) -> list[tuple]:
        return [e for e in self.events if e[0] in ("push", "verify", "move", "tag", "rmi")]


@pytest.fixture
def world(monkeypatch) -> World:
    return World(monkeypatch)


def _long(image: str) -> str:
    return f"{HOST}/team/{image}:1.0.0-cpu-abc123"


def _short(image: str) -> str:
    return f"{HOST}/team/{image}:1.0-cpu"


def _other_image(world: World, repo: str, tag: str) -> str:
    """Put a different image (another build) at repo:tag in the registry; return its digest."""
    other = world.docker.add_image(f"someone/else-{repo.replace('/', '-')}:{tag}")
    del world.docker.refs[f"someone/else-{repo.replace('/', '-')}:{tag}"]  # not a local image of this host
    return world.registry.put(repo, tag, world.docker.body(other))


# --------------------------------------------------------------------------- the phases of a release
def test_every_long_tag_is_verified_before_any_short_tag_moves(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    old = _other_image(world, "team/qwen3-embed", "1.0-cpu")  # the previous release's short tag

    results = world.publish([a, b], tmp_path)

    da, db = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123"), \
        world.registry.digest("team/qwen3-embed", "1.0.0-cpu-abc123")
    assert world.moves() == [
        ("push", _long("minilm-embed")), ("verify", "team/minilm-embed:1.0.0-cpu-abc123", da),
        ("push", _long("qwen3-embed")), ("verify", "team/qwen3-embed:1.0.0-cpu-abc123", db),
        ("move", "team/minilm-embed:1.0-cpu"), ("verify", "team/minilm-embed:1.0-cpu", da),
        ("move", "team/qwen3-embed:1.0-cpu"), ("verify", "team/qwen3-embed:1.0-cpu", db),
    ]  # no local tag made or removed: images go by id
    assert results == [
        PublishResult("minilm-embed:cpu", (_long("minilm-embed"), _short("minilm-embed")), da, False),
        PublishResult("qwen3-embed:cpu", (_long("qwen3-embed"), _short("qwen3-embed")), db, False),
    ]
    assert world.registry.digest("team/minilm-embed", "1.0-cpu") == da
    assert world.registry.digest("team/qwen3-embed", "1.0-cpu") == db != old
    assert world.docker.body(a.image_id)["config"]["digest"] == a.image_id
    assert f"  moved {_short('minilm-embed')}: absent -> {da}" in world.log
    assert f"  moved {_short('qwen3-embed')}: {old} -> {db}" in world.log
    assert set(world.docker.refs) == {"mopt/minilm-embed:cpu", "mopt/qwen3-embed:cpu"}
    assert world.registry.closed


def test_a_long_tag_failing_verification_moves_no_short_tag(world, tmp_path):
    a, b, c = world.item("minilm-embed"), world.item("qwen3-embed"), world.item("qwen3-chat")
    world.docker.lossy.add(b.image_id)  # b's layer never reaches the registry: its verification fails

    with pytest.raises(PublishError) as caught:
        world.publish([a, b, c], tmp_path)

    db = world.registry.digest("team/qwen3-embed", "1.0.0-cpu-abc123")
    exc = caught.value
    # The image's config blob (digest: the image id) is the first thing checked, and missing.
    assert exc.message == (f"qwen3-embed:cpu: team/qwen3-embed: blob {b.image_id} referenced by manifest {db} is "
                           "missing\n"
                           f"(no short tag was moved; verified long tags a re-run will skip: {_long('minilm-embed')})")
    assert str(exc) == exc.message and exc.args == (exc.message,) and exc.exit_code == 6
    assert exc.failed == "qwen3-embed:cpu"
    assert exc.published == [] and exc.long_verified == [_long("minilm-embed")]
    pushed = [e[1] for e in world.events if e[0] == "push"]
    assert pushed == [_long("minilm-embed"), _long("qwen3-embed")]  # nothing after the failure, no short tag
    for image in ("minilm-embed", "qwen3-embed", "qwen3-chat"):
        assert world.registry.digest(f"team/{image}", "1.0-cpu") is None
    assert world.registry.closed


def test_the_first_long_tag_failing_names_no_verified_tags(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    world.docker.lossy.add(a.image_id)
    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)
    assert caught.value.message.endswith("is missing\n(no short tag was moved)")
    assert caught.value.failed == "minilm-embed:cpu" and caught.value.long_verified == []
    assert [e[1] for e in world.events if e[0] == "push"] == [_long("minilm-embed")]


def test_a_long_tag_holding_another_image_is_refused_before_any_push(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    taken = _other_image(world, "team/qwen3-embed", "1.0.0-cpu-abc123")

    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)

    assert caught.value.message == (
        f"qwen3-embed:cpu: {_long('qwen3-embed')} already points at {taken} in the registry, which is not local "
        f"image {b.image_id}; {REFUSAL_TAIL}\n(no short tag was moved)")
    assert caught.value.failed == "qwen3-embed:cpu"
    assert caught.value.published == [] and caught.value.long_verified == []
    assert world.moves() == []  # phase 0: not even a's long tag was pushed
    assert world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123") is None


def test_a_long_tag_taken_by_a_racing_publisher_is_refused_in_phase_1(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    box = {}
    # Between phase 0 and b's push, another publisher takes b's long tag.
    world.registry.after_verify[("team/minilm-embed", "1.0.0-cpu-abc123")] = lambda: box.setdefault(
        "digest", _other_image(world, "team/qwen3-embed", "1.0.0-cpu-abc123"))

    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)

    assert caught.value.message == (
        f"qwen3-embed:cpu: {_long('qwen3-embed')} already points at {box['digest']} in the registry, which is not "
        f"local image {b.image_id}; {REFUSAL_TAIL}\n"
        f"(no short tag was moved; verified long tags a re-run will skip: {_long('minilm-embed')})")
    assert [e[1] for e in world.events if e[0] == "push"] == [_long("minilm-embed")]
    assert world.registry.digest("team/qwen3-embed", "1.0.0-cpu-abc123") == box["digest"]


def test_a_copy_that_sends_another_image_fails_the_identity_check(world, tmp_path):
    """Whatever went wrong in the copy, a long tag whose config is not the tested image stops the release
    before any short tag moves."""
    a = world.item("minilm-embed")
    other = world.docker.add_image("not the tested one")
    world.docker.push_as[_long("minilm-embed")] = other
    with pytest.raises(PublishError) as caught:
        world.publish([a], tmp_path)
    digest = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
    assert caught.value.message == (f"minilm-embed:cpu: {HOST}/team/minilm-embed:1.0.0-cpu-abc123 = {digest} holds "
                                    f"image {other}, not the smoke-tested {a.image_id}\n(no short tag was moved)")
    assert world.registry.digest("team/minilm-embed", "1.0-cpu") is None


def test_a_long_tag_of_this_image_with_a_missing_blob_is_repaired(world, tmp_path):
    a = world.item("minilm-embed")
    [first] = world.publish([a], tmp_path)
    layer = world.docker.images[a.image_id]["layer"]
    world.registry.blobs.discard(("team/minilm-embed", layer))
    world.events.clear()
    [again] = world.publish([a], tmp_path)
    assert again == PublishResult("minilm-embed:cpu", (_long("minilm-embed"),), first.digest, False)
    assert ("team/minilm-embed", layer) in world.registry.blobs
    assert [e[1] for e in world.events if e[0] == "push"] == [_long("minilm-embed")]
    assert any("holds this image but is incomplete" in line and "repairing" in line for line in world.log)


def test_a_rerun_skips_verified_long_tags_and_short_tags_already_there(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    first = world.publish([a, b], tmp_path)
    world.events.clear()

    again = world.publish([a, b], tmp_path)

    assert [e for e in world.events if e[0] in ("push", "tag")] == []
    assert again == [PublishResult(r.variant_id, (), r.digest, True) for r in first]
    assert [e for e in world.events if e[0] == "verify"] == [
        ("verify", "team/minilm-embed:1.0.0-cpu-abc123", first[0].digest),
        ("verify", "team/qwen3-embed:1.0.0-cpu-abc123", first[1].digest),
        ("verify", "team/minilm-embed:1.0-cpu", first[0].digest),
        ("verify", "team/qwen3-embed:1.0-cpu", first[1].digest),
    ]
    assert f"  {_long('minilm-embed')} already points at {first[0].digest} (this image): not pushed again" \
        in world.log


def _this_image_at_long_tag(world: World, item: PublishItem, known_by: str) -> str:
    """Put item's image at its long tag, recognisable by the way given; return the tag's digest."""
    repo = item.repository.replace("mopt/", "team/")
    body = world.docker.body(item.image_id)
    if known_by == "repo digest":
        # Another client pushed it (another compression: its own config digest); docker recorded the digest.
        digest = world.registry.put(repo, item.long_tag, world.docker.body(
            world.docker.add_image(f"re-compressed {repo}")))
        world.docker.images[item.image_id]["RepoDigests"] = [f"elsewhere.io/{repo}@{_sha('x')}",
                                                             f"{HOST}/{repo}@{digest}"]
        return digest
    if known_by == "config digest":
        return world.registry.put(repo, item.long_tag, body)
    child = world.registry.store(repo, body)
    other = world.registry.store(repo, world.docker.body(world.docker.add_image(f"arm64 {repo}")))
    return world.registry.put(repo, item.long_tag, {
        "schemaVersion": 2, "mediaType": INDEX, "manifests": [{"digest": other}, {"digest": child}]})


@pytest.mark.parametrize("known_by", ["repo digest", "config digest", "index"])
def test_a_long_tag_already_holding_this_image_is_not_pushed(world, tmp_path, known_by):
    a = world.item("minilm-embed")
    digest = _this_image_at_long_tag(world, a, known_by)
    if known_by != "config digest":
        # docker would push its own manifest, not this one: the short tag must already be there too.
        world.registry.tags[("team/minilm-embed", "1.0-cpu")] = digest

    [result] = world.publish([a], tmp_path)

    moved = () if known_by != "config digest" else (_short("minilm-embed"),)
    assert result == PublishResult("minilm-embed:cpu", moved, digest, True)
    assert [e for e in world.events if e[0] == "push"] == []  # nothing copied: the long tag holds this image
    assert [e[1] for e in world.events if e[0] == "move"] == ["team/minilm-embed:1.0-cpu"] * len(moved)
    assert world.registry.digest("team/minilm-embed", "1.0-cpu") == digest


def test_a_repo_digest_under_another_registry_is_not_this_image(world, tmp_path):
    a = world.item("minilm-embed")
    other = world.docker.add_image("re-compressed")
    digest = world.registry.put("team/minilm-embed", "1.0.0-cpu-abc123", world.docker.body(other))
    world.docker.images[a.image_id]["RepoDigests"] = [f"elsewhere.io/team/minilm-embed@{digest}",
                                                      f"{HOST}/mopt/minilm-embed@{digest}"]
    with pytest.raises(PublishError, match="long tags are immutable"):
        world.publish([a], tmp_path)
    assert world.moves() == []


def test_a_short_tag_moved_by_another_publisher_meanwhile_fails_and_names_the_moved_ones(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    box = {}
    world.registry.after_put[("team/qwen3-embed", "1.0-cpu")] = lambda: box.setdefault(
        "digest", _other_image(world, "team/qwen3-embed", "1.0-cpu"))

    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)

    da = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
    db = world.registry.digest("team/qwen3-embed", "1.0.0-cpu-abc123")
    assert caught.value.message == (
        f"qwen3-embed:cpu: {HOST}/team/qwen3-embed:1.0-cpu points at {box['digest']}, expected {db}\n"
        "(short tags already moved: minilm-embed:cpu)")
    assert caught.value.failed == "qwen3-embed:cpu" and caught.value.long_verified == []
    assert caught.value.published == [
        PublishResult("minilm-embed:cpu", (_long("minilm-embed"), _short("minilm-embed")), da, False)]


def test_a_short_tag_failing_verification_fails(world, tmp_path):
    a = world.item("minilm-embed")

    def lose_the_layer() -> None:
        world.registry.blobs.discard(("team/minilm-embed", world.docker.images[a.image_id]["layer"]))
        world.docker.lossy.add(a.image_id)

    world.registry.after_verify[("team/minilm-embed", "1.0.0-cpu-abc123")] = lose_the_layer
    with pytest.raises(PublishError) as caught:
        world.publish([a], tmp_path)
    assert caught.value.message.startswith("minilm-embed:cpu: team/minilm-embed: blob ")
    assert caught.value.message.endswith(" is missing")  # the first item: no short tag moved before it
    assert caught.value.published == []
    assert [e[1] for e in world.events if e[0] in ("push", "move")] == [_long("minilm-embed"),
                                                                        "team/minilm-embed:1.0-cpu"]


def test_a_failed_copy_fails_the_release_and_moves_no_short_tag(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    world.docker.push_outputs[_long("qwen3-embed")] = ["unauthorized: authentication required"]
    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)
    assert caught.value.message == (
        f"qwen3-embed:cpu: copying image {b.image_id[:19]} to {_long('qwen3-embed')} failed: unauthorized: "
        f"authentication required\n(no short tag was moved; verified long tags a re-run will skip: "
        f"{_long('minilm-embed')})")
    assert [e for e in world.events if e[0] == "move"] == []


# --------------------------------------------------------------------------- publish(): inputs and wiring
@pytest.mark.parametrize("second", [
    dict(variant="qwen3-embed:cpu", repository="mopt/minilm-embed", long_tag="1.0.0-cpu-abc123", short_tag="2"),
    dict(variant="qwen3-embed:cpu", repository="mopt/minilm-embed", long_tag="2.0.0", short_tag="1.0-cpu"),
    # The registry's namespace replaces the planned one: both land in team/minilm-embed.
    dict(variant="qwen3-embed:cpu", repository="other/minilm-embed", long_tag="2.0.0", short_tag="1.0-cpu"),
    # One item's short tag is another's long tag.
    dict(variant="qwen3-embed:cpu", repository="mopt/minilm-embed", long_tag="1.0-cpu", short_tag="2"),
])
def test_two_items_publishing_the_same_tag_are_refused(world, tmp_path, second):
    a = world.item("minilm-embed")
    b = PublishItem(second["variant"], a.image_id, second["repository"], second["long_tag"], second["short_tag"])
    clash = "1.0.0-cpu-abc123" if second["long_tag"] == "1.0.0-cpu-abc123" else "1.0-cpu"
    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)
    assert caught.value.message == f"qwen3-embed:cpu and minilm-embed:cpu would both publish team/minilm-embed:{clash}"
    assert world.events == [] and world.api_args == []


def test_the_same_item_twice_is_not_a_clash(world, tmp_path):
    a = world.item("minilm-embed")
    results = world.publish(iter([a, a]), tmp_path)
    digest = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
    assert results == [PublishResult("minilm-embed:cpu", (_long("minilm-embed"), _short("minilm-embed")), digest,
                                     False),
                       PublishResult("minilm-embed:cpu", (), digest, True)]


def test_credentials_and_config_dir_reach_the_api_and_docker(world, tmp_path):
    auth = base64.b64encode(b"ci:s3cret").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {HOST: {"auth": auth}}}))
    a = world.item("minilm-embed")
    world.publish([a], tmp_path)
    assert world.api_args == [(REGISTRY, Credentials(str(tmp_path / "config.json"), "ci", "s3cret"), tmp_path,
                               None)]
    assert world.docker.pushes == [(_long("minilm-embed"), tmp_path, ["s3cret"])]
    assert "s3cret" not in "\n".join(world.log)


def test_without_credentials_nothing_is_redacted(world, tmp_path):
    world.publish([world.item("minilm-embed")], tmp_path)
    assert world.api_args == [(REGISTRY, None, tmp_path, None)]
    assert [p[2] for p in world.docker.pushes] == [[]]


def test_the_docker_cli_is_looked_up_only_when_none_is_given(world, tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "find_docker", lambda: CLI)
    [result] = world.publish([world.item("minilm-embed")], tmp_path, docker=None)
    assert result.references == (_long("minilm-embed"), _short("minilm-embed"))


def test_the_api_is_closed_when_the_release_fails(world, tmp_path):
    a = world.item("minilm-embed", image_id=_sha("removed after its smoke test"))
    with pytest.raises(PublishError):
        world.publish([a], tmp_path)
    assert world.registry.closed


# --------------------------------------------------------------------------- phase 0, the shared plan
def test_the_plan_says_what_each_long_tag_holds_and_changes_nothing(world):
    fresh, held, other, gone = (world.item("minilm-embed"), world.item("qwen3-embed"), world.item("chat"),
                                world.item("lost", image_id=_sha("removed after its smoke test")))
    world.registry.put("team/qwen3-embed", "1.0.0-cpu-abc123", world.docker.body(held.image_id))
    taken = _other_image(world, "team/chat", "1.0.0-cpu-abc123")
    before = list(world.events)
    planned = phases.plan([fresh, held, other, gone], REGISTRY, world.registry, CLI)
    assert [e for e in world.events[len(before):] if e[0] in ("push", "tag")] == []
    by_id = {p.item.variant_id: p for p in planned}
    assert (by_id["minilm-embed:cpu"].remote_long, by_id["minilm-embed:cpu"].same_image,
            by_id["minilm-embed:cpu"].error) == (None, False, None)
    assert by_id["qwen3-embed:cpu"].same_image and by_id["qwen3-embed:cpu"].error is None
    assert by_id["chat:cpu"].remote_long.digest == taken and not by_id["chat:cpu"].same_image
    assert "long tags are immutable" in by_id["chat:cpu"].error.message
    lost = by_id["lost:cpu"]  # could not be checked: nothing about it is known
    assert (lost.local, lost.remote_long, lost.same_image) == (None, None, False)
    assert "not found" in lost.error.message


def test_a_real_run_stops_planning_at_the_first_item_it_cannot_publish(world, tmp_path):
    items = [world.item("a"), world.item("b", image_id=_sha("gone")), world.item("c"), world.item("d")]
    lookups = []
    manifest = world.registry.manifest
    world.registry.manifest = lambda repo, ref: lookups.append((repo, ref)) or manifest(repo, ref)
    with pytest.raises(PublishError, match="b:cpu: local image"):
        world.publish(items, tmp_path)
    assert lookups == [("team/a", "1.0.0-cpu-abc123")]  # c and d never asked: a down registry fails fast
    lookups.clear()
    with pytest.raises(PublishError, match="dry run"):
        world.publish(items, tmp_path, dry_run=True)
    long_lookups = {repo for repo, ref in lookups if ref == "1.0.0-cpu-abc123"}
    assert long_lookups == {"team/a", "team/c", "team/d"}  # the dry run goes on past b to list every problem


# --------------------------------------------------------------------------- the local image
def test_a_missing_local_image_fails_before_any_push(world, tmp_path):
    a = world.item("minilm-embed")
    gone = _sha("removed after its smoke test")
    b = world.item("qwen3-embed", image_id=gone)
    with pytest.raises(PublishError) as caught:
        world.publish([a, b], tmp_path)
    assert caught.value.message == (f"qwen3-embed:cpu: local image {gone} not found (was it removed after its "
                                    "smoke test?)\n(no short tag was moved)")
    assert world.moves() == []


def test_a_short_image_id_must_resolve_to_the_smoke_tested_image(world):
    full = world.docker.add_image("mopt/minilm-embed:cpu")
    item = PublishItem("minilm-embed:cpu", full[:19], "mopt/minilm-embed", "1.0.0", "1.0")
    with pytest.raises(PublishError) as caught:
        phases.local_image(CLI, item)
    assert caught.value.message == f"{full[:19]} resolves to image {full}, not the smoke-tested one"


def test_a_local_image_named_by_reference_is_used_as_it_resolves(world):
    full = world.docker.add_image("mopt/minilm-embed:cpu")
    item = PublishItem("minilm-embed:cpu", "mopt/minilm-embed:cpu", "mopt/minilm-embed", "1.0.0", "1.0")
    assert phases.local_image(CLI, item) == push.LocalImage(full, ())
    assert phases.local_image(CLI, PublishItem("x", full, "mopt/x", "1", "2")).id == full


def test_refs_use_the_registry_namespace():
    item = PublishItem("minilm-embed:cpu", _sha("x"), "mopt/minilm-embed", "1.0.0-cpu-abc123", "1.0-cpu")
    assert phases.refs(item, REGISTRY) == Refs("team/minilm-embed", f"{HOST}/team/minilm-embed",
                                              _long("minilm-embed"), _short("minilm-embed"))
    assert phases.refs(item, Registry.parse(HOST)) == Refs("mopt/minilm-embed", f"{HOST}/mopt/minilm-embed",
                                                          f"{HOST}/mopt/minilm-embed:1.0.0-cpu-abc123",
                                                          f"{HOST}/mopt/minilm-embed:1.0-cpu")


# --------------------------------------------------------------------------- _fail's notes
ITEM = PublishItem("qwen3-embed:cpu", _sha("q"), "mopt/qwen3-embed", "1.0.0", "1.0")
DONE = PublishResult("minilm-embed:cpu", ("r:1.0.0", "r:1.0"), _sha("m"), False)


@pytest.mark.parametrize("published, long_verified, phase, note", [
    ([], [], "long", "\n(no short tag was moved)"),
    ([], ["h/a:1.0.0", "h/b:1.0.0"], "long",
     "\n(no short tag was moved; verified long tags a re-run will skip: h/a:1.0.0, h/b:1.0.0)"),
    ([], [], "short", ""),
    ([DONE, PublishResult("chat:cpu", (), _sha("c"), True)], [], "short",
     "\n(short tags already moved: minilm-embed:cpu, chat:cpu)"),
])
def test_fail_prefixes_the_variant_and_notes_what_moved(published, long_verified, phase, note):
    exc = PublishError("boom")
    out = phases.fail(exc, ITEM, published, long_verified, moving_short_tags=phase == "short")
    assert out is exc
    assert exc.message == "qwen3-embed:cpu: boom" + note
    assert str(exc) == exc.message and exc.args == (exc.message,)
    assert exc.failed == "qwen3-embed:cpu"
    assert exc.published == published and exc.published is not published
    assert exc.long_verified == long_verified and exc.long_verified is not long_verified


# --------------------------------------------------------------------------- the dry run
def test_dry_run_changes_nothing_and_logs_what_would_move(world, tmp_path):
    a = world.item("minilm-embed")
    a = PublishItem(a.variant_id, "mopt/minilm-embed:cpu", a.repository, a.long_tag, a.short_tag)  # by name
    ida = world.docker.resolve(a.image_id)
    b, c, e = world.item("qwen3-embed"), world.item("qwen3-chat"), world.item("qwen3-rerank")
    # a: new; b, c, e: this image is there (told by its repo digest, an index, the config digest);
    # b's short tag is there too, c's points elsewhere, e has none.
    db = _this_image_at_long_tag(world, b, "repo digest")
    world.registry.tags[("team/qwen3-embed", "1.0-cpu")] = db
    dc = _this_image_at_long_tag(world, c, "index")
    old = _other_image(world, "team/qwen3-chat", "1.0-cpu")
    de = _this_image_at_long_tag(world, e, "config digest")
    tags_before, refs_before = dict(world.registry.tags), dict(world.docker.refs)

    results = world.publish([a, b, c, e], tmp_path, dry_run=True)

    assert results == [
        PublishResult("minilm-embed:cpu", (_long("minilm-embed"), _short("minilm-embed")), "", False),
        PublishResult("qwen3-embed:cpu", (), db, True),
        PublishResult("qwen3-chat:cpu", (_short("qwen3-chat"),), dc, True),
        PublishResult("qwen3-rerank:cpu", (_short("qwen3-rerank"),), de, True),
    ]
    assert world.moves() == [] and [e for e in world.events if e[0] == "rmi"] == []
    assert world.registry.tags == tags_before and world.docker.refs == refs_before
    assert world.log == [
        "[dry-run] phase 1: immutable long tags (pushed and verified first)",
        f"[dry-run] {_long('minilm-embed')} -> {ida} (registry: no such tag) : would push",
        f"[dry-run] {_long('qwen3-embed')} -> {b.image_id} (registry: {db}, same image) : would skip",
        f"[dry-run] {_long('qwen3-chat')} -> {c.image_id} (registry: {dc}, same image) : would skip",
        f"[dry-run] {_long('qwen3-rerank')} -> {e.image_id} (registry: {de}, same image) : would skip",
        "[dry-run] phase 2: moving short tags (only after every long tag above is verified)",
        f"[dry-run] {_short('minilm-embed')} -> {ida} (registry: no such tag) : would push",
        f"[dry-run] {_short('qwen3-embed')} -> {b.image_id} (registry: {db}) : already there",
        f"[dry-run] {_short('qwen3-chat')} -> {c.image_id} (registry: {old}) : would push",
        f"[dry-run] {_short('qwen3-rerank')} -> {e.image_id} (registry: no such tag) : would push",
    ]
    assert world.registry.closed


def test_dry_run_raises_when_the_real_run_would_be_refused(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    gone = _sha("removed after its smoke test")
    c = world.item("qwen3-chat", image_id=gone)
    d = world.item("qwen3-rerank")
    taken = _other_image(world, "team/qwen3-embed", "1.0.0-cpu-abc123")
    world.registry.failing.add(("team/qwen3-rerank", "1.0-cpu"))
    tags_before = dict(world.registry.tags)

    # Each problem item is followed by another: the plan goes on checking after a problem.
    with pytest.raises(PublishError) as caught:
        world.publish([a, c, d, b], tmp_path, dry_run=True)

    unreachable = f"registry {HOST} kept failing: HTTP 503 (after 5 attempts)"
    assert caught.value.message == (
        "dry run: the publish would fail:\n"
        f"  qwen3-chat:cpu: local image {gone} not found (was it removed after its smoke test?)\n"
        f"  qwen3-embed:cpu: {_long('qwen3-embed')} already points at {taken}, a different image than "
        f"{b.image_id}; long tags are immutable\n"
        f"  qwen3-rerank:cpu: {unreachable}")  # phase 1's problems first, then phase 2's
    assert caught.value.published == [] and caught.value.exit_code == 6
    assert world.moves() == [] and world.registry.tags == tags_before
    assert world.log == [
        "[dry-run] phase 1: immutable long tags (pushed and verified first)",
        f"[dry-run] {_long('minilm-embed')} -> {a.image_id} (registry: no such tag) : would push",
        f"  qwen3-chat:cpu: cannot check: local image {gone} not found (was it removed after its smoke test?)",
        f"[dry-run] {_long('qwen3-rerank')} -> {d.image_id} (registry: no such tag) : would push",
        f"[dry-run] {_long('qwen3-embed')} -> {b.image_id} (registry: {taken}, DIFFERENT image) : would REFUSE",
        "[dry-run] phase 2: moving short tags (only after every long tag above is verified)",
        f"[dry-run] {_short('minilm-embed')} -> {a.image_id} (registry: no such tag) : would not move",
        f"[dry-run] {_short('qwen3-chat')} -> {gone} (registry: no such tag) : would not move",
        f"  qwen3-rerank:cpu: cannot check: {unreachable}",
        f"[dry-run] {_short('qwen3-embed')} -> {b.image_id} (registry: no such tag) : would not move",
    ]



# --------------------------------------------------------------------------- promote: the fan-in
def _records(world: World, tmp_path, *images: str) -> list[LongTagRecord]:
    """What each runner's long-only publish leaves: one record per variant."""
    items = [world.item(image) for image in images]
    results = world.publish(items, tmp_path, long_only=True)
    assert [e for e in world.events if e[0] == "move"] == []  # long-only: no short tag moved
    world.events.clear()
    return [LongTagRecord(i.variant_id, i.image_id, i.repository, i.long_tag, i.short_tag, str(REGISTRY), r.digest)
            for i, r in zip(items, results, strict=True)]


def test_promote_verifies_every_long_tag_then_moves_the_short_tags(world, tmp_path):
    records = _records(world, tmp_path, "minilm-embed", "qwen3-embed")
    results = phases.promote(records, ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY,
                             docker_config=str(tmp_path), log=world.log.append)
    da, db = records[0].digest, records[1].digest
    assert world.moves() == [
        ("verify", "team/minilm-embed:1.0.0-cpu-abc123", da), ("verify", "team/qwen3-embed:1.0.0-cpu-abc123", db),
        ("move", "team/minilm-embed:1.0-cpu"), ("verify", "team/minilm-embed:1.0-cpu", da),
        ("move", "team/qwen3-embed:1.0-cpu"), ("verify", "team/qwen3-embed:1.0-cpu", db)]
    assert results == [PublishResult("minilm-embed:cpu", (_short("minilm-embed"),), da, False),
                       PublishResult("qwen3-embed:cpu", (_short("qwen3-embed"),), db, False)]
    assert "all 2 long tags of the release verified; moving the short tags" in world.log
    world.events.clear()
    again = phases.promote(records, ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path),
                           log=world.log.append)
    assert [r.skipped for r in again] == [True, True] and [e for e in world.events if e[0] == "move"] == []
    assert world.registry.closed


def test_promote_without_every_record_moves_nothing(world, tmp_path):
    records = _records(world, tmp_path, "minilm-embed")
    with pytest.raises(PublishError) as caught:
        phases.promote(records, ["minilm-embed:cpu", "qwen3-embed:cpu", "chat:cpu"], REGISTRY,
                       docker_config=str(tmp_path), log=world.log.append)
    assert caught.value.message == ("no long-tag record for qwen3-embed:cpu, chat:cpu (its job failed or did not "
                                    "publish); no short tag was moved")
    assert world.events == [] and world.registry.digest("team/minilm-embed", "1.0-cpu") is None


def test_promote_refuses_records_of_another_registry(world, tmp_path):
    [record] = _records(world, tmp_path, "minilm-embed")
    elsewhere = LongTagRecord(**{**record.to_json(), "registry": "10.0.0.1:5000"})
    with pytest.raises(PublishError, match="records name registry 10.0.0.1:5000, not 127.0.0.1:5000/team"):
        phases.promote([elsewhere], ["minilm-embed:cpu"], REGISTRY, docker_config=str(tmp_path))
    assert world.events == []


def test_promote_refuses_a_record_the_registry_no_longer_matches(world, tmp_path):
    a, b = _records(world, tmp_path, "minilm-embed", "qwen3-embed")
    forged = LongTagRecord(**{**b.to_json(), "image_id": a.image_id})  # b's long tag holds b, not a
    with pytest.raises(PublishError) as caught:
        phases.promote([a, forged], ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path),
                       log=world.log.append)
    assert caught.value.message == (
        f"qwen3-embed:cpu: {HOST}/team/qwen3-embed:1.0.0-cpu-abc123 = {b.digest} holds image {b.image_id}, not the "
        f"smoke-tested {a.image_id}\n(no short tag was moved; verified long tags a re-run will skip: "
        f"{_long('minilm-embed')})")
    assert [e for e in world.events if e[0] == "move"] == []
    moved_elsewhere = LongTagRecord(**{**b.to_json(), "digest": a.digest})  # the tag points at another digest
    with pytest.raises(PublishError, match=f"points at {b.digest}, expected {a.digest}"):
        phases.promote([moved_elsewhere], ["qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path))


def test_promote_with_a_signature_check_moves_nothing_until_every_long_tag_passes(world, tmp_path):
    """Where signing is configured, promote asks CHECK_SIGNED about every long tag, in the verify phase:
    one refusal (here the second) stops the release with no short tag moved."""
    records = _records(world, tmp_path, "minilm-embed", "qwen3-embed")
    asked = []

    def check(api, refs, long_tag):
        assert api is world.registry  # the check reads signatures through the registry client promote opened
        asked.append((refs.long, long_tag))
        if refs.repo == "team/qwen3-embed":
            raise PublishError(f"{refs.long} is not signed by any of the 1 verify key(s): no image signature")
    with pytest.raises(PublishError) as caught:
        phases.promote(records, ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path),
                       log=world.log.append, check_signed=check)
    assert asked == [(f"{HOST}/team/minilm-embed:1.0.0-cpu-abc123", "1.0.0-cpu-abc123"),
                     (f"{HOST}/team/qwen3-embed:1.0.0-cpu-abc123", "1.0.0-cpu-abc123")]
    assert caught.value.message.startswith(
        f"qwen3-embed:cpu: {HOST}/team/qwen3-embed:1.0.0-cpu-abc123 is not signed by any of the 1 verify key(s)")
    assert "no short tag was moved" in caught.value.message
    assert [e for e in world.events if e[0] == "move"] == []
    phases.promote(records, ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path),
                   check_signed=lambda api, refs, tag: None)
    assert len([e for e in world.events if e[0] == "move"]) == 2


def test_long_tag_records_read_back_and_refuse_anything_else():
    record = LongTagRecord("a:cpu", _sha("image"), "mopt/a", "1.0.0", "1.0", "127.0.0.1:5000", _sha("m"))
    assert LongTagRecord.from_json(json.loads(json.dumps(record.to_json())), "r.json") == record
    assert record.item() == PublishItem("a:cpu", _sha("image"), "mopt/a", "1.0.0", "1.0")
    for bad in ([], {}, {**record.to_json(), "extra": "x"}, {**record.to_json(), "digest": ""},
                {**record.to_json(), "long_tag": 1}):
        with pytest.raises(PublishError, match="r.json: not a long-tag record"):
            LongTagRecord.from_json(bad, "r.json")


def test_after_long_runs_for_every_item_between_the_phases_and_its_failure_moves_nothing(world, tmp_path):
    a, b = world.item("minilm-embed"), world.item("qwen3-embed")
    seen = []

    def sign(item, refs, digest, api):
        seen.append((item.variant_id, refs.long, digest, [e[0] for e in world.events].count("move")))

    world.publish([a, b], tmp_path, after_long=sign)
    da = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
    db = world.registry.digest("team/qwen3-embed", "1.0.0-cpu-abc123")
    assert seen == [("minilm-embed:cpu", _long("minilm-embed"), da, 0),
                    ("qwen3-embed:cpu", _long("qwen3-embed"), db, 0)]

    world.events.clear()
    c = world.item("chat", long_tag="2.0.0", short_tag="2.0")

    def refuse(item, refs, digest, api):
        raise PublishError("signing failed")

    with pytest.raises(PublishError) as caught:
        world.publish([c], tmp_path, after_long=refuse)
    assert caught.value.message == "chat:cpu: signing failed\n(no short tag was moved; verified long tags a re-run " \
                                   f"will skip: {HOST}/team/chat:2.0.0)"
    assert [e for e in world.events if e[0] == "move"] == []


def test_long_only_results_and_what_the_copy_and_the_hook_are_given(world, tmp_path, monkeypatch):
    copies, hooks = [], []
    fake = phases.copy_image

    def copy(image_id, ref, config_dir, *, insecure, log, redact=()):
        copies.append((image_id, ref, config_dir, insecure))
        return fake(image_id, ref, config_dir, insecure=insecure, log=log, redact=redact)

    monkeypatch.setattr(phases, "copy_image", copy)
    a = world.item("minilm-embed")
    [result] = world.publish([a], tmp_path, long_only=True,
                             after_long=lambda item, refs, digest, api: hooks.append(api))
    digest = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
    assert result == PublishResult("minilm-embed:cpu", (_long("minilm-embed"),), digest, False)
    assert copies == [(a.image_id, _long("minilm-embed"), tmp_path, True)]  # the api's insecure: loopback
    assert hooks == [world.registry]
    assert "all 1 long tags verified; short tags left to `mopt promote`" in world.log


def test_a_verified_manifest_gone_before_its_short_tag_moves_is_an_error(world, tmp_path):
    a = world.item("minilm-embed")

    def lose_it() -> None:
        digest = world.registry.digest("team/minilm-embed", "1.0.0-cpu-abc123")
        del world.registry.manifests[("team/minilm-embed", digest)]

    world.registry.after_verify[("team/minilm-embed", "1.0.0-cpu-abc123")] = lose_it
    with pytest.raises(PublishError) as caught:
        world.publish([a], tmp_path)
    assert caught.value.message.startswith(f"minilm-embed:cpu: {HOST}/team/minilm-embed@sha256:")
    assert "vanished from the registry before" in caught.value.message
    assert _short("minilm-embed") in caught.value.message


def test_the_identity_error_names_every_config_or_none(world, tmp_path, monkeypatch):
    a = world.item("minilm-embed")
    repo = "team/minilm-embed"
    x, y = world.docker.add_image("arm64 build"), world.docker.add_image("amd64 build")
    children = [world.registry.store(repo, world.docker.body(i)) for i in (y, x)]
    index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [{"digest": c} for c in children]}
    # A copy that stored an index of two other images under the long tag.
    monkeypatch.setattr(phases, "copy_image", lambda image_id, ref, config_dir, **kw: world.registry.put(
        repo, "1.0.0-cpu-abc123", index))
    with pytest.raises(PublishError) as caught:
        world.publish([a], tmp_path)
    digest = world.registry.digest(repo, "1.0.0-cpu-abc123")
    assert f"= {digest} holds image {', '.join(sorted([x, y]))}, not the smoke-tested {a.image_id}" in \
        caught.value.message
    empty = {"schemaVersion": 2, "mediaType": INDEX, "manifests": []}
    p = phases.PlannedItem(item=a, refs=phases.refs(a, REGISTRY), local=push.LocalImage(a.image_id, ()),
                           remote_long=None, same_image=True, error=None)
    none_digest = world.registry.put(repo, "empty", empty)
    with pytest.raises(PublishError, match=r"holds image \(none\), not the smoke-tested"):
        phases.verify_identity(world.registry, p, "empty", none_digest)


def test_promote_uses_the_release_credentials_and_names_every_other_registry(world, tmp_path):
    auth = base64.b64encode(b"ci:s3cret").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {HOST: {"auth": auth}}}))
    records = _records(world, tmp_path, "minilm-embed")
    world.api_args.clear()
    phases.promote(records, ["minilm-embed:cpu"], REGISTRY, docker_config=str(tmp_path), log=world.log.append)
    assert world.api_args == [(REGISTRY, Credentials(str(tmp_path / "config.json"), "ci", "s3cret"), tmp_path, None)]
    two = [LongTagRecord(**{**records[0].to_json(), "registry": r, "variant_id": v})
           for r, v in (("10.0.0.1:5000", "a:cpu"), ("10.0.0.2:5000", "b:cpu"))]
    with pytest.raises(PublishError, match="records name registry 10.0.0.1:5000, 10.0.0.2:5000, not"):
        phases.promote(two, ["a:cpu", "b:cpu"], REGISTRY, docker_config=str(tmp_path))


def test_a_short_tag_failing_in_promote_names_the_ones_moved(world, tmp_path):
    a, b = _records(world, tmp_path, "minilm-embed", "qwen3-embed")
    box = {}
    world.registry.after_put[("team/qwen3-embed", "1.0-cpu")] = lambda: box.setdefault(
        "digest", _other_image(world, "team/qwen3-embed", "1.0-cpu"))
    with pytest.raises(PublishError) as caught:
        phases.promote([a, b], ["minilm-embed:cpu", "qwen3-embed:cpu"], REGISTRY, docker_config=str(tmp_path),
                       log=world.log.append)
    exc = caught.value
    assert exc.message == (f"qwen3-embed:cpu: {HOST}/team/qwen3-embed:1.0-cpu points at {box['digest']}, expected "
                           f"{b.digest}\n(short tags already moved: minilm-embed:cpu)")
    assert exc.failed == "qwen3-embed:cpu" and exc.long_verified == []
    assert exc.published == [PublishResult("minilm-embed:cpu", (_short("minilm-embed"),), a.digest, False)]


def test_a_record_error_names_the_expected_keys():
    with pytest.raises(PublishError) as caught:
        LongTagRecord.from_json({}, "r.json")
    assert caught.value.message == ("r.json: not a long-tag record (expected the keys variant_id, image_id, "
                                    "repository, long_tag, short_tag, registry, digest)")
