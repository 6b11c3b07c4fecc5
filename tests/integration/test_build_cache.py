"""BuildKit's layer cache shared through a real authenticated registry (--cache-registry).

The real Builder builds the minilm-embed:cpu runtime stage (Engine 20.10's built-in BuildKit: an
inline cache, exported by id with skopeo) with one more RUN step whose output is random. The cache
records BuildKit made since the test began are then deleted and the stage image removed, so only the
registry can supply the layer: rebuilt with the cache, the random bytes come back unchanged; without
it (the control) they differ."""
from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest
import requests

from builder.backends import backend
from builder.build import Builder, BuildOptions, default_ca_bundle, default_find_links
from builder.buildcache import RegistryCache
from builder.dockerclient import run_docker
from builder.localregistry import LocalRegistry, docker_login
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.registry.api import ACCEPT
from tests.integration.conftest import STATE, copy_matrix

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration
VARIANT = "minilm-embed:cpu"
CHECK_FILE = "/etc/mopt-cache-test"


def _cache_records() -> dict[str, dict]:
    """BuildKit's cache records on the daemon: id -> record (Type, Description, Shared, ...)."""
    raw = subprocess.run(["curl", "-s", "--unix-socket", "/var/run/docker.sock", "http://localhost/system/df"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return {r["ID"]: r for r in json.loads(raw).get("BuildCache") or []}


def _made_since(before: set[str]) -> list[str]:
    """Layer records made since BEFORE that a prune can delete: not cache mounts (pip's and apt's caches),
    not shared with an image (a cache import can bring records for layers the base stage's image holds;
    they stay while it does, in CI's second run on a pruned daemon 2 did)."""
    return [i for i, r in _cache_records().items()
            if i not in before and r.get("Type") != "exec.cachemount" and not r.get("Shared")]


def _drop_local_cache(docker, before: set[str]) -> int:
    """Delete the layer records BuildKit made since BEFORE (this test's steps, and what a cache import
    brought in)."""
    dropped: set[str] = set()
    for _ in range(8):  # a record still referenced by a later one goes only once that one has gone
        made = _made_since(before)
        if not made:
            break
        for cache_id in made:
            run_docker(["builder", "prune", "-f", "--filter", f"id={cache_id}"], docker=docker, timeout=120)
        dropped.update(made)
    return len(dropped)


def _random_bytes(docker, image: str) -> str:
    return run_docker(["run", "--rm", "--network", "none", "--entrypoint", "cat", image, CHECK_FILE],
                      docker=docker, timeout=120).stdout.strip()


def test_a_stage_layer_comes_back_from_the_registry_cache(docker_cli, tmp_path, monkeypatch):
    token = secrets.token_hex(8)
    with LocalRegistry(tmp_path / "registry", user="cache", password="pw-" + secrets.token_hex(8)) as reg:
        config = tmp_path / "docker-config"
        docker_login(reg.address, reg.user, reg.password, config_dir=config)
        monkeypatch.setenv("DOCKER_CONFIG", str(config))  # BuildKit reads the cache with these credentials
        (tmp_path / "work").mkdir()
        work = copy_matrix(tmp_path / "work")
        matrix = load_matrix(work / "matrix.yaml")
        plan = make_plan(matrix)
        (variant,) = [v for v in plan.variants if v.id == VARIANT]
        template = work / "templates" / backend(variant.backend).runtime_template
        template.write_text(template.read_text() + f"RUN : cache-test-{token}; "
                            f"head -c 16 /dev/urandom | od -An -tx1 > {CHECK_FILE}\n")
        cache = RegistryCache.parse(reg.address, config)
        options = BuildOptions(state_dir=STATE, templates=work / "templates", ca_bundle=default_ca_bundle(),
                               find_links=default_find_links(), cache=cache)
        lines: list[str] = []
        builder = Builder(matrix, plan.variants, options, log=lines.append, docker=docker_cli)
        stage_tag = ""
        # The shipped runtime first (its base stage with it): on a cold daemon they are built here, and their
        # layer records, held by their images, stay whatever is pruned: they belong to BEFORE.
        shipped = BuildOptions(state_dir=STATE, templates=REPO / "templates", ca_bundle=default_ca_bundle(),
                               find_links=default_find_links())
        Builder(matrix, plan.variants, shipped, log=lines.append, docker=docker_cli).runtime(variant)
        before = set(_cache_records())
        try:
            first = builder.runtime(variant).runtime
            assert not first.skipped
            stage_tag = first.image
            ref = cache.ref("runtime", variant.image, variant.tag)
            assert f"  layer cache -> {ref}" in lines
            session = requests.Session()
            session.trust_env, session.auth = False, (reg.user, reg.password)
            repo, tag = ref.split("/", 1)[1].split(":")
            manifest = session.get(f"{reg.url}/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=30)
            manifest.raise_for_status()
            config_digest = manifest.json()["config"]["digest"]
            assert config_digest == first.image_id  # the stage image itself, pushed by id
            blob = session.get(f"{reg.url}/v2/{repo}/blobs/{config_digest}", timeout=30).json()
            assert "moby.buildkit.cache.v0" in blob  # the inline cache travels in the config
            original = _random_bytes(docker_cli, first.image_id)

            def rebuilt(with_cache: bool) -> str:
                run_docker(["rmi", first.image], docker=docker_cli)  # first: an image keeps its records
                assert _drop_local_cache(docker_cli, before) >= 1
                assert not _made_since(before)
                # the random step's own record is gone: only the registry (or running it again) can give it
                assert not [r for r in _cache_records().values() if token in (r.get("Description") or "")]
                again = Builder(matrix, plan.variants, options if with_cache else
                                BuildOptions(state_dir=STATE, templates=work / "templates",
                                             ca_bundle=default_ca_bundle(), find_links=default_find_links()),
                                log=lines.append, docker=docker_cli).runtime(variant).runtime
                assert not again.skipped
                return _random_bytes(docker_cli, again.image_id)

            assert rebuilt(with_cache=True) == original  # the layer came from the registry
            assert rebuilt(with_cache=False) != original  # the control: without it the step runs again
        finally:
            if stage_tag:  # this test's own runtime stage (its template is unique)
                run_docker(["rmi", stage_tag], docker=docker_cli, check=False)
            _drop_local_cache(docker_cli, before)
