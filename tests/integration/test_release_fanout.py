"""A release fanned out over machines, run locally as separate processes against a real authenticated
registry: each variant's job is its own `mopt publish --long-only` (a runner's share: long tag pushed
by image id, verified, recorded), and one `mopt promote` fans in. With one variant's job failing, the
promote refuses and no short tag moves; once every variant has its record, every short tag moves.

The images are one-file `docker import`s standing in for the built variants (their records and smoke
records written as mopt build and mopt test write them), so the test runs in seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.attest.dsse import make_key_pair
from builder.localregistry import docker_login
from builder.state import ModelRecord, SmokeRecord, StateDir, VariantRecord
from tests.integration.conftest import REPO
from tests.integration.test_publish import PASSWORD, Api, _import_image, docker, registry  # noqa: F401

pytestmark = pytest.mark.integration

VARIANTS = ("minilm-embed:cpu", "minilm-embed:cpu-vllm")


def mopt(*args: str, state: Path, config: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DOCKER_CONFIG=str(config), MOPT_STATE_DIR=str(state))
    env.pop("MOPT_MATRIX", None)
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def runner_state(tmp: Path, variant: str, image_id: str, passed: bool) -> Path:
    """One runner's state dir: the variant built (as image_id) and its smoke test passed or failed."""
    state = tmp / f"runner-{variant.replace(':', '-')}"
    image, tag = variant.split(":")
    record = VariantRecord(id=variant, image_id=image_id, references=(), engine_dir=state / "engines" / "x",
                           engine_sha256="", model=ModelRecord(source="generate:test", digest="", dimension=4,
                                                               substituted=False), stages=(), size_bytes=0)
    StateDir(state).create().write_record(image, tag, record)
    StateDir(state).write_smoke(image, tag, SmokeRecord(image_id=image_id, key="k", passed=passed))
    return state


def planned_tags(variant: str) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-m", "builder", "plan", "--format", "json", "--select", variant],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    (v,) = json.loads(out)["variants"]
    return v["tags"][0], v["tags"][1]  # (short, long)


def test_one_failed_variant_job_moves_no_short_tag_then_the_release_completes(docker, registry, tmp_path):  # noqa: F811
    config = tmp_path / "docker-config"
    docker_login(registry.address, registry.user, registry.password, config_dir=config)
    ids = {v: _import_image(docker, tmp_path, f"mopt-test/fanout-{i}:{tmp_path.name[-8:]}", f"variant {v}\n".encode())
           for i, v in enumerate(VARIANTS)}
    records = tmp_path / "records"  # what the fan-in job downloads from every runner's upload
    reg = registry.address
    api = Api(registry)

    # Fan-out: the first variant's job publishes its long tag; the second's smoke test failed.
    good = mopt("publish", "--select", VARIANTS[0], "--registry", reg, "--long-only", str(records / "job-0"),
                state=runner_state(tmp_path, VARIANTS[0], ids[VARIANTS[0]], True), config=config)
    assert good.returncode == 0, good.stdout + good.stderr
    bad_state = runner_state(tmp_path, VARIANTS[1], ids[VARIANTS[1]], False)
    bad = mopt("publish", "--select", VARIANTS[1], "--registry", reg, "--long-only", str(records / "job-1"),
               state=bad_state, config=config)
    assert bad.returncode == 6 and "has not passed its smoke test" in bad.stdout + bad.stderr
    short0, long0 = planned_tags(VARIANTS[0])
    short1, long1 = planned_tags(VARIANTS[1])
    assert api.digest("mopt/minilm-embed", long0) is not None  # the long tag is out ...
    assert api.digest("mopt/minilm-embed", short0) is None  # ... its short tag is not

    # Fan-in: one variant has no record, so nothing moves.
    fan_in = tmp_path / "fan-in"
    promoted = mopt("promote", "--select", "minilm-embed:cpu*", "--registry", reg, "--records", str(records),
                    state=fan_in, config=config)
    assert promoted.returncode == 6, promoted.stdout + promoted.stderr
    assert f"no long-tag record for {VARIANTS[1]}" in promoted.stderr and "no short tag was moved" in promoted.stderr
    assert api.digest("mopt/minilm-embed", short0) is None and api.digest("mopt/minilm-embed", short1) is None

    # A record that no longer matches the registry (another image under its long tag) is refused too.
    record_path = next((records / "job-0").glob("*.json"))
    record = json.loads(record_path.read_text())
    forged = dict(record, image_id=ids[VARIANTS[1]])
    (records / "forged").mkdir()
    (records / "forged" / "x.json").write_text(json.dumps(forged))
    record_path.unlink()
    refused = mopt("promote", "--select", VARIANTS[0], "--registry", reg, "--records", str(records),
                   state=fan_in, config=config)
    assert refused.returncode == 6 and f"not the smoke-tested {ids[VARIANTS[1]]}" in refused.stderr
    assert api.digest("mopt/minilm-embed", short0) is None
    (records / "forged" / "x.json").unlink()
    record_path.write_text(json.dumps(record))

    # Where signing is configured (--verify-key), the unsigned long tags stop the release: nothing moves.
    public = tmp_path / "release.pub"
    make_key_pair(tmp_path / "release.key", public)
    unsigned = mopt("promote", "--select", VARIANTS[0], "--registry", reg, "--records", str(records),
                    "--verify-key", str(public), state=fan_in, config=config)
    assert unsigned.returncode == 6, unsigned.stdout + unsigned.stderr
    assert (f"{reg}/mopt/minilm-embed:{long0} is not signed by any of the 1 verify key(s)" in unsigned.stderr
            and "no short tag was moved" in unsigned.stderr), unsigned.stderr
    assert api.digest("mopt/minilm-embed", short0) is None

    # The failed job re-run after a fix: its record arrives, and the promote moves every short tag.
    StateDir(bad_state).write_smoke("minilm-embed", "cpu-vllm", SmokeRecord(image_id=ids[VARIANTS[1]], key="k",
                                                                             passed=True))
    rerun = mopt("publish", "--select", VARIANTS[1], "--registry", reg, "--long-only", str(records / "job-1"),
                 state=bad_state, config=config)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    done = mopt("promote", "--select", "minilm-embed:cpu*", "--registry", reg, "--records", str(records),
                state=fan_in, config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    for short, long in ((short0, long0), (short1, long1)):
        assert api.digest("mopt/minilm-embed", short) == api.digest("mopt/minilm-embed", long) is not None
    report = (fan_in / "reports" / "promote.md").read_text()
    assert "| minilm-embed:cpu |" in report and "| minilm-embed:cpu-vllm |" in report and "moved" in report
    assert PASSWORD not in done.stdout + done.stderr + report
