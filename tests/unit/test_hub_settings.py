"""hf:// sources without the network: where the token, endpoint and offline switch come from, the model
card's license, the lock check and the cache lookup."""
from __future__ import annotations

import json

import pytest

from builder import hub
from builder.errors import ConfigError

SHA = "a" * 40


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "HF_HUB_OFFLINE", "MOPT_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return monkeypatch


def test_defaults_are_the_public_hub_online_without_a_token(clean_env):
    assert hub.HubSettings.from_env() == hub.HubSettings("https://huggingface.co", None, False)


def test_the_token_comes_from_hf_token_first_then_the_files(clean_env, tmp_path):
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_from_login\n")
    assert hub.HubSettings.from_env().token == "hf_from_login"
    (tmp_path / "named").write_text("hf_from_path\n")
    clean_env.setenv("HF_TOKEN_PATH", str(tmp_path / "named"))
    assert hub.HubSettings.from_env().token == "hf_from_path"
    clean_env.setenv("HF_TOKEN", "hf_from_env")
    assert hub.HubSettings.from_env().token == "hf_from_env"


def test_a_named_token_file_that_is_missing_is_one_clear_error(clean_env, tmp_path):
    clean_env.setenv("HF_TOKEN_PATH", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="HF_TOKEN_PATH=.*nope: no such file") as err:
        hub.HubSettings.from_env()
    assert err.value.exit_code == 2


def test_the_token_never_shows_in_repr(clean_env):
    clean_env.setenv("HF_TOKEN", "hf_secret_value")
    settings = hub.HubSettings.from_env()
    assert "hf_secret_value" not in repr(settings) and "token=set" in repr(settings)


@pytest.mark.parametrize("name, value, offline", [("HF_HUB_OFFLINE", "1", True), ("HF_HUB_OFFLINE", "true", True),
                                                  ("MOPT_OFFLINE", "1", True), ("HF_HUB_OFFLINE", "0", False)])
def test_offline_switches(clean_env, name, value, offline):
    clean_env.setenv(name, value)
    assert hub.HubSettings.from_env().offline is offline
    if offline:
        assert hub.reachable(hub.HubSettings.from_env()) is False  # not even asked


def test_a_mirror_endpoint_is_used(clean_env):
    clean_env.setenv("HF_ENDPOINT", "https://hf-mirror.example/")
    assert hub.HubSettings.from_env().endpoint == "https://hf-mirror.example"


def test_offline_a_branch_never_resolved_here_is_refused(tmp_path):
    settings = hub.HubSettings("http://127.0.0.1:9", None, True)
    with pytest.raises(ConfigError, match="never resolved here"):
        hub.fetch("org/model@main", tmp_path, settings, print)
    with pytest.raises(ConfigError, match="not in the model cache"):
        hub.fetch(f"org/model@{SHA}", tmp_path, settings, print)


def _cache(tmp_path, files: dict[str, bytes]):
    target = tmp_path / "hf" / "org--model" / SHA
    target.mkdir(parents=True)
    for name, data in files.items():
        (target / name).write_bytes(data)
    manifest = {name: hub._sha256(target / name) for name in files}
    (target / hub.MANIFEST).write_text(json.dumps(manifest))
    refs = tmp_path / "hf" / "org--model" / "refs"
    refs.mkdir()
    (refs / "main").write_text(SHA + "\n")
    return target, manifest


def test_offline_a_cached_commit_is_used_through_its_branch(tmp_path):
    target, manifest = _cache(tmp_path, {"config.json": b"{}"})
    snapshot = hub.fetch("org/model@main", tmp_path, hub.HubSettings("http://127.0.0.1:9", None, True), print)
    assert (snapshot.sha, snapshot.path, snapshot.files) == (SHA, target, manifest)
    assert snapshot.source == f"hf://org/model@{SHA}"
    assert hub.cached("org/model@main", tmp_path) and hub.cached(f"org/model@{SHA}", tmp_path)
    assert not hub.cached("org/model@v2", tmp_path) and not hub.cached("org/other@main", tmp_path)


def test_a_locked_build_refuses_a_file_that_changed(tmp_path):
    target, manifest = _cache(tmp_path, {"config.json": b"{}", "model.safetensors": b"weights"})
    offline = hub.HubSettings("http://127.0.0.1:9", None, True)
    pinned = {"repo": "org/model", "revision": "main", "sha": SHA, "files": manifest}
    assert hub.fetch("org/model@main", tmp_path, offline, print, pinned=pinned).files == manifest
    (target / "model.safetensors").write_bytes(b"other weights")  # the manifest still says the old hash
    with pytest.raises(ConfigError, match="model.safetensors differs from the locked sha256") as err:
        hub.fetch("org/model@main", tmp_path, offline, print, pinned=pinned)
    assert err.value.exit_code == 2
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "extra.json").write_text("{}")  # a file the lock does not know is a change too
    with pytest.raises(ConfigError, match="extra.json differs"):
        hub.fetch("org/model@main", tmp_path, offline, print, pinned=pinned)


@pytest.mark.parametrize("card, license_id", [
    ("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Model\n", "apache-2.0"),
    ("---\nlicense: other\n---\n", "other"),
    ("# no front matter\nlicense: mit\n", None),
    ("---\nlicense: [mit, apache-2.0]\n---\n", None),  # not one id
    ("---\nlicense: 'mit\" onclick=x'\n---\n", None),  # never into a label as is
    ("---\n: : bad yaml [\n---\n", None),
])
def test_the_license_comes_from_the_model_card(tmp_path, card, license_id):
    (tmp_path / "README.md").write_text(card)
    assert hub.card_license(tmp_path) == license_id


def test_no_model_card_no_license(tmp_path):
    assert hub.card_license(tmp_path) is None
