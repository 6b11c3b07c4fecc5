"""builder.registry (publishing) against the real Docker daemon and a real authenticated registry.

Nothing is pulled: the two images are `docker import`s of one-file tars. Each test gets its own
LocalRegistry (tmp dir, free port, user/password) and its own DOCKER_CONFIG directory.
The registry client's pure parts (parsing, push output, the Bearer flow against an in-process fake
registry, credentials) are unit tests: tests/unit/test_registry_client.py.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import secrets
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import requests

from builder.dockerclient import DockerCli, find_docker, run_docker
from builder.errors import EnvironmentProblem, PublishError
from builder.localregistry import LocalRegistry, docker_login
from builder.registry.api import ACCEPT
from builder.registry.phases import PublishItem, publish
from builder.registry.reference import Registry

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-" + secrets.token_hex(6)
SUFFIX = secrets.token_hex(4)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def docker() -> DockerCli:
    try:
        cli = find_docker()
    except EnvironmentProblem as exc:
        pytest.skip(f"no Docker daemon reachable (run scripts/setup.sh to install and start dockerd): {exc}")
    if not shutil.which("docker-registry") and not shutil.which("registry"):
        pytest.skip("docker-registry (CNCF distribution) is not installed (apt-get install docker-registry)")
    return cli


def _import_image(docker: DockerCli, tmp: Path, name: str, content: bytes) -> str:
    tar_path = tmp / f"{name.replace('/', '_').replace(':', '_')}.tar"
    with tarfile.open(tar_path, "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size, info.mtime, info.mode = len(content), 1700000000, 0o644
        tar.addfile(info, io.BytesIO(content))
    run_docker(["import", str(tar_path), name], docker=docker, timeout=60)
    res = run_docker(["image", "inspect", "--format", "{{.Id}}", name], docker=docker, timeout=30)
    return res.stdout.strip()


@pytest.fixture(scope="module")
def images(docker, tmp_path_factory):
    """Two different tiny images: (id_a, id_b)."""
    tmp = tmp_path_factory.mktemp("images")
    names = [f"mopt-test/publish-a:{SUFFIX}", f"mopt-test/publish-b:{SUFFIX}"]
    ids = (_import_image(docker, tmp, names[0], b"image A\n"),
           _import_image(docker, tmp, names[1], b"image B, different\n"))
    assert ids[0] != ids[1]
    yield ids
    run_docker(["rmi", "-f", *names], docker=docker, check=False)


@pytest.fixture
def registry(docker, tmp_path):
    with LocalRegistry(tmp_path / "registry", user="pusher", password=PASSWORD) as reg:
        yield reg


@pytest.fixture
def docker_config(registry, tmp_path) -> Path:
    cfg = tmp_path / "docker-config"
    docker_login(registry.address, registry.user, registry.password, config_dir=cfg)
    return cfg


class Api:
    """The test's own view of the registry (plain requests with basic auth, no proxy)."""

    def __init__(self, reg: LocalRegistry):
        self.base, self.s = reg.url, requests.Session()
        self.s.trust_env = False
        self.s.auth = (reg.user, reg.password)

    def catalog(self) -> list[str]:
        r = self.s.get(f"{self.base}/v2/_catalog", timeout=10)
        r.raise_for_status()
        return r.json()["repositories"]

    def digest(self, repo: str, tag: str) -> str | None:
        r = self.s.get(f"{self.base}/v2/{repo}/manifests/{tag}", timeout=10,
                       headers={"Accept": ACCEPT})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        assert r.headers["Docker-Content-Digest"] == "sha256:" + hashlib.sha256(r.content).hexdigest()
        return r.headers["Docker-Content-Digest"]


def _local_refs(docker: DockerCli, image_id: str) -> list[str]:
    res = run_docker(["image", "inspect", "--format", "{{json .RepoTags}}", image_id], docker=docker)
    return json.loads(res.stdout)


def _item(image_id: str, name: str = "a", long_tag: str = "1.0.0-cpu-abc123", short_tag: str = "1.0-cpu"):
    return PublishItem(variant_id=f"tiny-{name}:cpu", image_id=image_id, repository="mopt/tiny",
                       long_tag=long_tag, short_tag=short_tag)


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def text(self) -> str:
        return "\n".join(self)


# --------------------------------------------------------------------------- publish
def test_publish_pushes_long_then_short_and_both_verify(docker, images, registry, docker_config):
    id_a, _ = images
    reg = Registry.parse(f"{registry.address}/team")  # the namespace replaces the planned "mopt"
    item = _item(id_a)
    log = Lines()
    before = _local_refs(docker, id_a)

    [res] = publish([item], reg, docker_config=str(docker_config), log=log)

    long_ref = f"{registry.address}/team/tiny:1.0.0-cpu-abc123"
    short_ref = f"{registry.address}/team/tiny:1.0-cpu"
    assert res.references == (long_ref, short_ref) and res.skipped is False
    assert res.variant_id == "tiny-a:cpu" and res.digest.startswith("sha256:")
    api = Api(registry)
    assert api.catalog() == ["team/tiny"]
    assert api.digest("team/tiny", "1.0.0-cpu-abc123") == res.digest
    assert api.digest("team/tiny", "1.0-cpu") == res.digest
    # Order: the long tag is pushed and verified before the short tag moves. The image goes once, by
    # its id (copy_image); the short tag is the verified manifest put under another name, no push.
    text = log.text()
    assert text.index(f"verified {long_ref}") < text.index(f"moved {short_ref}") < text.index(
        f"verified {short_ref}")
    assert text.count(" from image ") == 1 and f"pushed {long_ref} from image {id_a[:19]}" in text
    # skopeo agrees (credentials from the same config.json, not argv).
    if shutil.which("skopeo"):
        for ref in (long_ref, short_ref):
            out = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--authfile",
                                  str(docker_config / "config.json"), f"docker://{ref}"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout
            assert json.loads(out)["Digest"] == res.digest
    # The registry-prefixed local tags are gone; the image is kept.
    assert _local_refs(docker, id_a) == before
    assert PASSWORD not in text and base64.b64encode(f"pusher:{PASSWORD}".encode()).decode() not in text


def test_rerun_skips_the_long_tag_and_pushes_nothing(docker, images, registry, docker_config):
    id_a, _ = images
    reg = Registry.parse(registry.address)
    [first] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=Lines())
    log = Lines()
    [second] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=log)
    assert second.skipped is True and second.references == () and second.digest == first.digest
    assert " from image " not in log.text()
    assert "already points at" in log.text()
    # A new short tag for the same (already published) long tag: only the short tag moves.
    log = Lines()
    [third] = publish([_item(id_a, short_tag="1-cpu")], reg, docker_config=str(docker_config), log=log)
    assert third.skipped is True and third.digest == first.digest
    assert third.references == (f"{registry.address}/mopt/tiny:1-cpu",)
    assert Api(registry).digest("mopt/tiny", "1-cpu") == first.digest


def test_wrong_credentials_fail_clearly_and_push_nothing(docker, images, registry, tmp_path):
    id_a, _ = images
    bad = tmp_path / "bad-config"
    bad.mkdir()
    wrong = "not-the-password"
    auth = base64.b64encode(f"pusher:{wrong}".encode()).decode()
    (bad / "config.json").write_text(json.dumps({"auths": {registry.address: {"auth": auth}}}))
    log = Lines()
    with pytest.raises(PublishError) as exc:
        publish([_item(id_a)], Registry.parse(registry.address), docker_config=str(bad), log=log)
    msg = str(exc.value)
    assert exc.value.exit_code == 6
    assert "rejected the credentials" in msg and "'pusher'" in msg
    assert f"docker login {registry.address}" in msg
    assert wrong not in msg and wrong not in log.text() and auth not in msg
    # No credentials at all: says where it looked.
    empty = tmp_path / "empty-config"
    empty.mkdir()
    with pytest.raises(PublishError, match="no credentials for registry"):
        publish([_item(id_a)], Registry.parse(registry.address), docker_config=str(empty), log=Lines())
    assert Api(registry).catalog() == []
    assert not [r for r in _local_refs(docker, id_a) if r.startswith(registry.address)]


def test_long_tag_pointing_elsewhere_is_refused_and_short_tag_not_moved(docker, images, registry,
                                                                         docker_config):
    id_a, id_b = images
    reg = Registry.parse(registry.address)
    [first] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=Lines())
    api = Api(registry)

    with pytest.raises(PublishError) as exc:  # image B under A's long tag and the same short tag
        publish([_item(id_b, name="b")], reg, docker_config=str(docker_config), log=Lines())
    assert "immutable" in str(exc.value) and first.digest in str(exc.value) and id_b in str(exc.value)
    assert api.digest("mopt/tiny", "1.0.0-cpu-abc123") == first.digest
    assert api.digest("mopt/tiny", "1.0-cpu") == first.digest

    # The dry run foresees the same refusal and changes nothing either.
    log = Lines()
    with pytest.raises(PublishError, match="immutable"):
        publish([_item(id_b, name="b")], reg, docker_config=str(docker_config), dry_run=True, log=log)
    assert "REFUSE" in log.text()
    assert api.digest("mopt/tiny", "1.0-cpu") == first.digest
    assert not [r for r in _local_refs(docker, id_b) if r.startswith(registry.address)]


def test_short_tags_move_only_after_every_long_tag_is_verified(docker, images, registry, docker_config):
    id_a, id_b = images
    reg = Registry.parse(registry.address)
    a, b = _item(id_a), _item(id_b, name="b", long_tag="2.0.0-cpu-def456", short_tag="2.0-cpu")
    log = Lines()
    results = publish([a, b], reg, docker_config=str(docker_config), log=log)
    text = log.text()
    long_b, short_a = f"{registry.address}/mopt/tiny:2.0.0-cpu-def456", f"{registry.address}/mopt/tiny:1.0-cpu"
    assert text.index(f"verified {long_b}") < text.index("all 2 long tags verified") < text.index(
        f"moved {short_a}")
    assert [r.references[1] for r in results] == [short_a, f"{registry.address}/mopt/tiny:2.0-cpu"]

    # A release whose second long tag is taken by another image: refused before anything is pushed,
    # so neither its first long tag nor any short tag moves.
    c = _item(id_b, name="c", long_tag="3.0.0-cpu", short_tag="3.0-cpu")
    clash = _item(id_b, name="d", long_tag="1.0.0-cpu-abc123", short_tag="3.0-cpu-d")
    with pytest.raises(PublishError) as exc:
        publish([c, clash], reg, docker_config=str(docker_config), log=Lines())
    assert "immutable" in str(exc.value) and exc.value.failed == "tiny-d:cpu" and exc.value.published == []
    api = Api(registry)
    assert api.digest("mopt/tiny", "3.0.0-cpu") is None and api.digest("mopt/tiny", "3.0-cpu") is None
    assert api.digest("mopt/tiny", "1.0.0-cpu-abc123") == results[0].digest

    # The dry run lists every long tag before any short tag.
    log = Lines()
    publish([_item(id_a, name="e", long_tag="4.0.0-cpu", short_tag="4.0-cpu"),
             _item(id_b, name="f", long_tag="5.0.0-cpu", short_tag="5.0-cpu")], reg,
            docker_config=str(docker_config), dry_run=True, log=log)
    text = log.text()
    assert text.index("5.0.0-cpu ->") < text.index("phase 2") < text.index("4.0-cpu ->")


def test_dry_run_pushes_nothing(docker, images, registry, docker_config):
    id_a, id_b = images
    reg = Registry.parse(registry.address)
    log = Lines()
    results = publish([_item(id_a), _item(id_b, name="b", long_tag="2.0.0-cpu-def456", short_tag="2.0-cpu")],
                      reg, docker_config=str(docker_config), dry_run=True, log=log)
    assert [r.references for r in results] == [
        (f"{registry.address}/mopt/tiny:1.0.0-cpu-abc123", f"{registry.address}/mopt/tiny:1.0-cpu"),
        (f"{registry.address}/mopt/tiny:2.0.0-cpu-def456", f"{registry.address}/mopt/tiny:2.0-cpu")]
    assert all(r.digest == "" and not r.skipped for r in results)
    text = log.text()
    assert f"{registry.address}/mopt/tiny:1.0.0-cpu-abc123 -> {id_a}" in text and "no such tag" in text
    assert " from image " not in text
    assert Api(registry).catalog() == []
    assert not [r for r in _local_refs(docker, id_a) if r.startswith(registry.address)]

    # After a real publish, the dry run shows the current registry digest and that it would skip.
    [done] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=Lines())
    log = Lines()
    [again] = publish([_item(id_a)], reg, docker_config=str(docker_config), dry_run=True, log=log)
    assert again.skipped and again.references == () and done.digest in log.text()


def _config_digest(api: Api, repo: str, tag: str) -> str:
    r = api.s.get(f"{api.base}/v2/{repo}/manifests/{tag}", timeout=10, headers={"Accept": ACCEPT})
    r.raise_for_status()
    return r.json()["config"]["digest"]


def test_a_concurrent_retag_cannot_publish_another_image(docker, images, registry, docker_config):
    """While publish runs, another process keeps pointing every name of the release (the variant's local
    tag and the registry-prefixed one) at a different image. What lands under both tags is still the
    smoke-tested image: publish copies it by id, so no name on the daemon is read."""
    import threading

    id_a, id_b = images
    reg = Registry.parse(registry.address)
    names = [f"{registry.address}/mopt/tiny:1.0.0-cpu-abc123", f"{registry.address}/mopt/tiny:1.0-cpu",
             f"mopt-test/publish-a:{SUFFIX}"]
    stop = threading.Event()

    def retag() -> None:
        while not stop.is_set():
            for name in names:
                run_docker(["tag", id_b, name], docker=docker, check=False)

    thread = threading.Thread(target=retag, daemon=True)
    thread.start()
    try:
        [res] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=Lines())
    finally:
        stop.set()
        thread.join()
        run_docker(["tag", id_a, names[2]], docker=docker)
        run_docker(["rmi", "--no-prune", *names[:2]], docker=docker, check=False)
    api = Api(registry)
    for tag in ("1.0.0-cpu-abc123", "1.0-cpu"):
        assert api.digest("mopt/tiny", tag) == res.digest
        assert _config_digest(api, "mopt/tiny", tag) == id_a  # the tested image, not the re-tagged B


def test_a_long_tag_with_a_missing_blob_is_repaired_on_rerun(docker, images, registry, docker_config):
    id_a, _ = images
    reg = Registry.parse(registry.address)
    [first] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=Lines())
    api = Api(registry)
    manifest = api.s.get(f"{api.base}/v2/mopt/tiny/manifests/{first.digest}", timeout=10,
                         headers={"Accept": ACCEPT}).json()
    layer = manifest["layers"][0]["digest"]
    assert api.s.delete(f"{api.base}/v2/mopt/tiny/blobs/{layer}", timeout=10).status_code == 202
    assert api.s.head(f"{api.base}/v2/mopt/tiny/blobs/{layer}", timeout=10).status_code == 404

    log = Lines()
    [again] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=log)
    assert f"blob {layer} referenced by manifest {first.digest} is missing" in log.text()
    assert "repairing" in log.text() and again.skipped is False
    for tag in ("1.0.0-cpu-abc123", "1.0-cpu"):
        assert api.digest("mopt/tiny", tag) == again.digest and _config_digest(api, "mopt/tiny", tag) == id_a
    current = api.s.get(f"{api.base}/v2/mopt/tiny/manifests/{again.digest}", timeout=10,
                        headers={"Accept": ACCEPT}).json()
    for desc in current["layers"]:
        assert api.s.head(f"{api.base}/v2/mopt/tiny/blobs/{desc['digest']}", timeout=10).status_code == 200
    # Complete now: a third run pushes nothing.
    log = Lines()
    [third] = publish([_item(id_a)], reg, docker_config=str(docker_config), log=log)
    assert third.skipped and " from image " not in log.text()
