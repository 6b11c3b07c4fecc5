"""The base image's content key: what changes it and what must not (no docker needed)."""
from __future__ import annotations

import json

import pytest

from builder import base
from builder.base import BaseImage, BaseSpec, spec_from_mapping, state_path
from builder.errors import ConfigError, EnvironmentProblem

EPOCH = 1700000000


def spec(**kw) -> BaseSpec:
    kw.setdefault("name", "mopt/base:debian12")
    kw.setdefault("epoch", EPOCH)
    return BaseSpec(**kw)


def test_key_is_a_sha256_hex():
    k = spec().key
    assert len(k) == 64 and int(k, 16) >= 0


def test_key_stable_across_package_order_and_duplicates():
    a = spec(packages=("python3", "ca-certificates", "curl"))
    b = spec(packages=("curl", "python3", "ca-certificates", "curl", " python3 "))
    assert a.key == b.key
    assert a.packages == ("ca-certificates", "curl", "python3")
    assert b.packages == a.packages


def test_key_accepts_lists_and_is_independent_of_name():
    assert spec(packages=["bb", "a1"]).key == spec(packages=("a1", "bb"), name="other/name:x").key


def test_key_changes_with_packages():
    assert spec(packages=("python3",)).key != spec(packages=("python3", "curl")).key
    assert spec().key != spec(packages=("curl",)).key
    assert spec(packages=("python3=3.11.2-1+b1",)).key != spec(packages=("python3",)).key


def test_key_changes_with_epoch():
    assert spec(epoch=EPOCH).key != spec(epoch=EPOCH + 1).key


@pytest.mark.parametrize("field,value", [
    ("suite", "trixie"),
    ("variant", "apt"),
    ("mirror", "http://snapshot.debian.org/archive/debian/20240101T000000Z"),
    ("components", ("main", "contrib")),
    ("slim", False),
    ("changes", ('CMD ["/bin/sh"]',)),
])
def test_key_changes_with_other_inputs(field, value):
    assert spec(**{field: value}).key != spec().key


def test_mirror_trailing_slash_does_not_matter():
    assert spec(mirror="http://deb.debian.org/debian/").key == spec().key


@pytest.mark.parametrize("bad", ["Python3", "a,b", "x y", "-rf", "pkg;rm"])
def test_bad_package_names_are_config_errors(bad):
    with pytest.raises(ConfigError) as exc:
        spec(packages=(bad,))
    assert exc.value.exit_code == 2


@pytest.mark.parametrize("kw", [
    {"name": "Mopt/Base"}, {"epoch": -1}, {"epoch": "1700000000"}, {"variant": "tiny"},
    {"mirror": "deb.debian.org"}, {"suite": "Bookworm!"},
])
def test_bad_specs_are_config_errors(kw):
    with pytest.raises(ConfigError):
        spec(**kw)


def test_state_path_is_a_flat_slug(tmp_path):
    p = state_path(tmp_path, "mopt/base:debian12")
    assert p == tmp_path / "mopt_base_debian12.json"


def test_spec_from_mapping():
    s = spec_from_mapping("mopt/base:debian12", {"packages": ["python3", "ca-certificates"]},
                          default_epoch=EPOCH)
    assert s == spec(packages=("ca-certificates", "python3"))
    with pytest.raises(ConfigError, match="unknown base option"):
        spec_from_mapping("mopt/base:debian12", {"pakages": []}, default_epoch=EPOCH)
    with pytest.raises(ConfigError, match="must be a list"):
        spec_from_mapping("mopt/base:debian12", {"packages": "python3"}, default_epoch=EPOCH)
    with pytest.raises(ConfigError, match="missing epoch"):
        spec_from_mapping("mopt/base:debian12", {})


def test_base_image_json_roundtrip():
    img = BaseImage(name="mopt/base:debian12", image_id="sha256:" + "a" * 64, key=spec().key,
                    packages=("python3",), epoch=EPOCH, created_seconds=1.5, manifest=("bash=5",))
    doc = json.loads(json.dumps(img.to_json()))
    assert "reused" not in doc
    assert BaseImage.from_json(doc) == img
    assert BaseImage.from_json(doc, reused=True).reused


def test_no_rootfs_tool_is_an_environment_problem(monkeypatch):
    monkeypatch.setattr(base.shutil, "which", lambda *a, **k: None)
    with pytest.raises(EnvironmentProblem, match="apt-get install mmdebstrap") as exc:
        base.pick_tool()
    assert exc.value.exit_code == 7


def test_debootstrap_fallback_when_mmdebstrap_missing(monkeypatch):
    monkeypatch.setattr(base.shutil, "which",
                        lambda name, **k: "/usr/sbin/debootstrap" if name == "debootstrap" else None)
    assert base.pick_tool() == ("debootstrap", "/usr/sbin/debootstrap")


def test_the_runtime_stage_key_covers_every_file_the_stage_copies(tmp_path):
    """openapi.json (served at /openapi.json) and any other non-Python file of the runtime package are
    copied into the runtime stage: changing one must change the stage's key."""
    import shutil

    from builder.render import RUNTIME_PACKAGE, runtime_digest

    copy = tmp_path / "runtime"
    shutil.copytree(RUNTIME_PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = runtime_digest(copy)
    assert before == runtime_digest(RUNTIME_PACKAGE)
    doc = copy / "openapi.json"
    doc.write_text(doc.read_text() + " ")
    assert runtime_digest(copy) != before
    (copy / "new-data.txt").write_text("x")
    assert runtime_digest(copy) not in (before,)
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "junk.pyc").write_bytes(b"x")  # byte-code is not copied: no new key
    after = runtime_digest(copy)
    (copy / "__pycache__" / "more.pyc").write_bytes(b"y")
    assert runtime_digest(copy) == after


def test_the_wheel_carries_the_runtimes_data_files():
    """pyproject's package-data: every non-Python file the runtime reads at run time is in the wheel."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    from builder.render import RUNTIME_PACKAGE

    repo = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["builder"]
    # (NAME.py.meta, NAME.py.spans: the mutation tool's notes beside each module in its scratch copy)
    data = [p.relative_to(RUNTIME_PACKAGE.parent).as_posix() for p in RUNTIME_PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py" and ".py." not in p.name]
    assert data and "runtime/openapi.json" in data
    for name in data:
        assert any(fnmatch(name, pattern) for pattern in patterns), name
