"""mopt verify-repro's logic (builder/repro.py) without Docker: which builds it asks for (two from scratch, or
the variant as built against one from scratch), how it compares the two images' file manifests and what its
report says. The Builder and the daemon are stood in for; the real two builds of the cpu demo image are
tests/integration/test_lock_repro.py's."""
import json
from types import SimpleNamespace

import pytest

from builder import repro
from builder.build import BuildOptions

pytestmark = pytest.mark.timeout(60)
VARIANT = SimpleNamespace(id="demo:cpu", image="demo", tag="cpu")
FILE = {"type": "0", "mode": "0o644", "size": 3, "uid": 0, "gid": 0, "sha256": "ab"}


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """The builds repro asks for (their options), the docker calls it makes, and each image's files."""
    seen = {"builds": [], "docker": []}
    manifests = {}

    class Builder:
        def __init__(self, matrix, all_variants, options, log, docker):
            self.options = options

        def build(self, variant):
            seen["builds"].append(self.options)
            return SimpleNamespace(image_id=f"sha256:{len(seen['builds'])}")

    def run_docker(argv, docker, check=True):
        seen["docker"].append(argv)
        return SimpleNamespace(stdout="")

    monkeypatch.setattr(repro, "Builder", Builder)
    monkeypatch.setattr(repro, "find_docker", lambda: "docker")
    monkeypatch.setattr(repro, "run_docker", run_docker)
    monkeypatch.setattr(repro, "image_manifest", lambda docker, ref: manifests[ref])
    options = BuildOptions(state_dir=tmp_path / "state", templates=tmp_path)
    return seen, manifests, options


def _set(manifests, a: dict, b: dict):
    manifests["mopt-repro/demo:cpu-a"], manifests["mopt-repro/demo:cpu-b"] = a, b


def test_by_default_both_images_are_built_from_scratch(stand_ins):
    seen, manifests, options = stand_ins
    _set(manifests, {"etc/x": FILE}, {"etc/x": FILE})
    report = repro.verify_repro(None, (), VARIANT, options, log=lambda _: None)
    assert [o.force for o in seen["builds"]] == [True, True]
    assert report["first_build"] == "from scratch" and report["reproducible"] and report["differences"] == []
    assert report["images"] == ["sha256:1", "sha256:2"] and report["files"] == 1
    # both kept under their own tags while compared, then untagged (never pruned: they are the variant's)
    assert ["tag", "sha256:1", "mopt-repro/demo:cpu-a"] in seen["docker"]
    assert ["rmi", "--no-prune", "mopt-repro/demo:cpu-b"] in seen["docker"]
    written = json.loads(options.state.repro_report("demo", "cpu").read_text())
    assert written["reproducible"] is True and written["first_build"] == "from scratch"


def test_against_built_takes_the_variant_as_built_then_one_build_from_scratch(stand_ins):
    seen, manifests, options = stand_ins
    _set(manifests, {"etc/x": FILE}, {"etc/x": FILE})
    lines = []
    report = repro.verify_repro(None, (), VARIANT, options, log=lines.append, against_built=True)
    assert [o.force for o in seen["builds"]] == [False, True]
    assert seen["builds"][0] is options  # the user's options as given: the cache and the engine reused
    assert report["first_build"] == "as built" and report["reproducible"]
    assert "build a of 2, as built" in lines[0] and "build b of 2, from scratch" in lines[1]


def test_a_changed_file_is_a_difference_and_a_volatile_one_is_only_reported(stand_ins):
    seen, manifests, options = stand_ins
    changed = dict(FILE, sha256="cd")
    _set(manifests, {"etc/x": FILE, "var/log/dpkg.log": FILE, "gone": FILE},
         {"etc/x": changed, "var/log/dpkg.log": changed, "new": FILE})
    report = repro.verify_repro(None, (), VARIANT, options, log=lambda _: None)
    assert not report["reproducible"]
    assert [(d["path"], d["change"]) for d in report["differences"]] == [
        ("etc/x", "changed"), ("gone", "removed"), ("new", "added")]
    (ignored,) = report["ignored"]
    assert ignored["path"] == "var/log/dpkg.log" and "apt and dpkg logs" in ignored["ignored_because"]
    text = repro.summary(report)
    assert "3 differ, 1 ignored as volatile" in text and "/etc/x" in text and "sha256 ab -> cd" in text
