"""mopt warm's checks before any container runs (builder/warm.py): what it refuses and what it chowns."""
from __future__ import annotations

import os

import pytest

from builder.errors import ConfigError
from builder.warm import _cache_user, _check_paths


@pytest.fixture
def model(tmp_path):
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    return m


def test_a_model_with_links_outside_it_is_refused(model, tmp_path):
    (tmp_path / "blob").write_text("weights")
    (model / "model.safetensors").symlink_to(tmp_path / "blob")
    with pytest.raises(ConfigError, match="links outside the directory"):
        _check_paths(model, tmp_path / "cache", ())


@pytest.mark.parametrize("args", [("--model-id", "/x"), ("--cache-dir=/tmp/c",)])
def test_the_runtime_flags_warm_sets_itself_are_refused(model, tmp_path, args):
    with pytest.raises(ConfigError, match="set by mopt warm"):
        _check_paths(model, tmp_path / "cache", args)


def test_a_directory_that_is_not_a_cache_is_refused(model, tmp_path):
    srv = tmp_path / "srv"
    (srv / "engines").mkdir(parents=True)
    (srv / "important.db").write_text("x")
    with pytest.raises(ConfigError, match="not a mopt engine cache"):
        _check_paths(model, srv, ())
    with pytest.raises(ConfigError, match="overlap"):
        _check_paths(model, model / "cache", ())
    (srv / "important.db").unlink()
    _check_paths(model, srv, ("--max-seq-len", "128"))  # a cache: accepted


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root; as another user warm runs as that user")
def test_only_the_cache_and_its_two_top_dirs_are_handed_over(tmp_path):
    cache = tmp_path / "cache"
    (cache / "engines" / "k").mkdir(parents=True)
    (cache / "engines" / "k" / "f").write_text("x")
    victim = tmp_path / "victim"
    victim.write_text("root's")
    (cache / "digests").symlink_to(victim)  # a planted link is not followed
    assert _cache_user({"User": "10001:10001"}, cache) == "10001:10001"
    assert (cache.stat().st_uid, (cache / "engines").stat().st_uid) == (10001, 10001)
    assert (cache / "engines" / "k").stat().st_uid == 0 and victim.stat().st_uid == 0
