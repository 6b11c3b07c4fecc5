"""hf:// sources without the network: where the token, endpoint and offline switch come from, the model
card's license, the lock check and the cache lookup."""
from __future__ import annotations

import json

import pytest

from builder import hubs
from builder.errors import ConfigError
from builder.hashing import sha256_file
from builder.hubs.huggingface import HuggingFace
from builder.hubs.modelscope import ModelScope

SHA = "a" * 40


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT", "HF_HUB_OFFLINE", "MOPT_OFFLINE", "MODELSCOPE_ENDPOINT",
                 "MODELSCOPE_DOMAIN", "MODELSCOPE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return monkeypatch


def test_defaults_are_the_public_hub_online_without_a_token(clean_env):
    assert HuggingFace.from_env().settings == hubs.HubSettings("https://huggingface.co", None, False)


def test_the_token_comes_from_hf_token_first_then_the_files(clean_env, tmp_path):
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_from_login\n")
    assert HuggingFace.from_env().settings.token == "hf_from_login"
    (tmp_path / "named").write_text("hf_from_path\n")
    clean_env.setenv("HF_TOKEN_PATH", str(tmp_path / "named"))
    assert HuggingFace.from_env().settings.token == "hf_from_path"
    clean_env.setenv("HF_TOKEN", "hf_from_env")
    assert HuggingFace.from_env().settings.token == "hf_from_env"


def test_a_named_token_file_that_is_missing_is_one_clear_error(clean_env, tmp_path):
    clean_env.setenv("HF_TOKEN_PATH", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="HF_TOKEN_PATH=.*nope: no such file") as err:
        HuggingFace.from_env()
    assert err.value.exit_code == 2


def test_the_token_never_shows_in_repr(clean_env):
    clean_env.setenv("HF_TOKEN", "hf_secret_value")
    settings = HuggingFace.from_env().settings
    assert "hf_secret_value" not in repr(settings) and "token=set" in repr(settings)


@pytest.mark.parametrize("name, value, offline", [("HF_HUB_OFFLINE", "1", True), ("HF_HUB_OFFLINE", "true", True),
                                                  ("MOPT_OFFLINE", "1", True), ("HF_HUB_OFFLINE", "0", False)])
def test_offline_switches(clean_env, name, value, offline):
    clean_env.setenv(name, value)
    assert HuggingFace.from_env().settings.offline is offline
    if offline:
        assert hubs.reachable(HuggingFace.from_env().settings) is False  # not even asked


def test_a_mirror_endpoint_is_used(clean_env):
    clean_env.setenv("HF_ENDPOINT", "https://hf-mirror.example/")
    assert HuggingFace.from_env().settings.endpoint == "https://hf-mirror.example"


def test_offline_a_branch_never_resolved_here_is_refused(tmp_path):
    offline = HuggingFace(hubs.HubSettings("http://127.0.0.1:9", None, True))
    with pytest.raises(ConfigError, match="never resolved here"):
        hubs.fetch(offline, "org/model@main", tmp_path, print)
    with pytest.raises(ConfigError, match="not in the model cache"):
        hubs.fetch(offline, f"org/model@{SHA}", tmp_path, print)


def _cache(tmp_path, files: dict[str, bytes]):
    target = tmp_path / "hf" / "org--model" / SHA
    target.mkdir(parents=True)
    for name, data in files.items():
        (target / name).write_bytes(data)
    manifest = {name: sha256_file(target / name) for name in files}
    (target / hubs.MANIFEST).write_text(json.dumps(manifest))
    refs = tmp_path / "hf" / "org--model" / "refs"
    refs.mkdir()
    (refs / "main").write_text(SHA + "\n")
    return target, manifest


def test_offline_a_cached_commit_is_used_through_its_branch(tmp_path):
    target, manifest = _cache(tmp_path, {"config.json": b"{}"})
    offline = HuggingFace(hubs.HubSettings("http://127.0.0.1:9", None, True))
    snapshot = hubs.fetch(offline, "org/model@main", tmp_path, print)
    assert (snapshot.commit, snapshot.path, snapshot.files) == (SHA, target, manifest)
    assert snapshot.source == f"hf://org/model@{SHA}"
    assert hubs.cached("hf", "org/model@main", tmp_path) and hubs.cached("hf", f"org/model@{SHA}", tmp_path)
    assert not hubs.cached("hf", "org/model@v2", tmp_path) and not hubs.cached("hf", "org/other@main", tmp_path)
    assert not hubs.cached("modelscope", "org/model@main", tmp_path)  # each hub its own cache


def test_a_locked_build_refuses_a_file_that_changed(tmp_path):
    target, manifest = _cache(tmp_path, {"config.json": b"{}", "model.safetensors": b"weights"})
    offline = HuggingFace(hubs.HubSettings("http://127.0.0.1:9", None, True))
    pinned = {"repo": "org/model", "revision": "main", "sha": SHA, "files": manifest}
    assert hubs.fetch(offline, "org/model@main", tmp_path, print, pinned=pinned).files == manifest
    (target / "model.safetensors").write_bytes(b"other weights")  # the manifest still says the old hash
    with pytest.raises(ConfigError, match="model.safetensors differs from the locked sha256") as err:
        hubs.fetch(offline, "org/model@main", tmp_path, print, pinned=pinned)
    assert err.value.exit_code == 2
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "extra.json").write_text("{}")  # a file the lock does not know is a change too
    with pytest.raises(ConfigError, match="extra.json differs"):
        hubs.fetch(offline, "org/model@main", tmp_path, print, pinned=pinned)


@pytest.mark.parametrize("card, license_id", [
    ("---\nlicense: apache-2.0\nlibrary_name: transformers\n---\n# Model\n", "apache-2.0"),
    ("---\nlicense: other\n---\n", "other"),
    ("# no front matter\nlicense: mit\n", None),
    ("---\nlicense: [mit, apache-2.0]\n---\n", None),  # not one id
    ("---\nlicense: 'mit\" onclick=x'\n---\n", None),  # never into a label as is
    ("---\n: : bad yaml [\n---\n", None),
    ("---\nlicense: !foo mit\n---\n", None),  # a tag it cannot construct: no license, no traceback
    ("---\nlicense: mit\nyear: !!int abc\n---\n", None),
])
def test_the_license_comes_from_the_model_card(tmp_path, card, license_id):
    (tmp_path / "README.md").write_text(card)
    assert hubs.card_license(tmp_path) == license_id


def test_no_model_card_no_license(tmp_path):
    assert hubs.card_license(tmp_path) is None


def test_modelscope_settings_come_from_its_own_variables(clean_env):
    assert ModelScope.from_env().settings == hubs.HubSettings("https://www.modelscope.cn", None, False)
    clean_env.setenv("MODELSCOPE_DOMAIN", "mirror.example")  # the older name, a bare host
    assert ModelScope.from_env().settings.endpoint == "https://mirror.example"
    clean_env.setenv("MODELSCOPE_ENDPOINT", "http://127.0.0.1:8/")
    clean_env.setenv("MODELSCOPE_API_TOKEN", " ms-token ")
    clean_env.setenv("HF_HUB_OFFLINE", "1")  # the Hugging Face switch is not ModelScope's
    assert ModelScope.from_env().settings == hubs.HubSettings("http://127.0.0.1:8", "ms-token", False)
    clean_env.setenv("MOPT_OFFLINE", "1")
    assert ModelScope.from_env().settings.offline is True


@pytest.mark.parametrize("commit", ["../../../etc", "A" * 40, "a" * 39, ""])
def test_a_commit_that_is_not_40_hex_digits_never_names_a_directory(tmp_path, commit):
    offline = HuggingFace(hubs.HubSettings("http://127.0.0.1:9", None, True))
    pinned = {"repo": "org/model", "revision": "main", "sha": commit, "files": {}}
    with pytest.raises(ConfigError, match="is not a commit id"):
        hubs.fetch(offline, "org/model@main", tmp_path, print, pinned=pinned)
    refs = tmp_path / "hf" / "org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text(commit + "\n")  # a cache someone edited
    with pytest.raises(ConfigError, match="is not a commit id"):
        hubs.fetch(offline, "org/model@main", tmp_path, print)
