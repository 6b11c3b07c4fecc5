"""modelscope:// sources through the real modelscope SDK (modelscope_hub) against tests/msstub.py, a local
stand-in for ModelScope (these machines cannot reach it): a branch resolved to its commit, only what
engines read, private models and tokens, a download cut short, the lock's pins, the same cache rules
as the Hugging Face Hub's."""
from __future__ import annotations

import hashlib

import pytest

from builder import hubs
from builder.errors import ConfigError, EnvironmentProblem
from builder.hubs.modelscope import ModelScope
from tests.msstub import MsStub

REPO_ID = "Qwen/tiny-embed"
FILES = {"config.json": b'{"model_type": "qwen3"}', "tokenizer.json": b'{"v": 1}', "merges.txt": b"a b\n",
         "model.safetensors": bytes(range(256)) * 1024, "README.md": b"---\nlicense: apache-2.0\n---\n",
         "onnx/model.onnx": b"onnx" * 64, "pytorch_model.bin": b"pickle" * 64}
WANTED = sorted(set(FILES) - {"onnx/model.onnx", "pytorch_model.bin"})


@pytest.fixture
def stub(monkeypatch, tmp_path):
    # The SDK keeps a session file and may cache under these: keep them in the test's directory.
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))
    with MsStub() as running:
        yield running


def fetch(stub, tmp_path, ref=f"{REPO_ID}@master", token=None, pinned=None, offline=False):
    client = ModelScope(hubs.HubSettings(endpoint=stub.endpoint, token=token, offline=offline))
    return hubs.fetch(client, ref, tmp_path / "models", lambda line: None, pinned=pinned)


def gets(stub, name: str) -> int:
    return sum(1 for method, path, *_ in stub.requests if method == "GET" and f"FilePath={name}" in path.replace(
        "%2F", "/"))


def test_a_branch_resolves_to_its_commit_and_only_what_engines_read_is_downloaded(stub, tmp_path):
    commit = stub.add_repo(REPO_ID, FILES)
    snapshot = fetch(stub, tmp_path)
    assert snapshot.commit == commit and snapshot.source == f"modelscope://{REPO_ID}@{commit}"
    assert snapshot.path == tmp_path / "models" / "modelscope" / "Qwen--tiny-embed" / commit
    assert snapshot.files == {name: hashlib.sha256(FILES[name]).hexdigest() for name in WANTED}
    assert all((snapshot.path / name).read_bytes() == FILES[name] for name in WANTED)
    assert gets(stub, "onnx/model.onnx") == 0 and gets(stub, "pytorch_model.bin") == 0
    assert not (snapshot.path / ".cache").exists() and hubs.card_license(snapshot.path) == "apache-2.0"
    # A cached commit is not downloaded again; a moved branch is a new commit, the old one kept.
    before = gets(stub, "model.safetensors")
    assert fetch(stub, tmp_path).commit == commit and gets(stub, "model.safetensors") == before
    moved = stub.add_repo(REPO_ID, {**FILES, "config.json": b'{"model_type": "qwen3", "v": 2}'})
    assert fetch(stub, tmp_path).commit == moved != commit and (snapshot.path / "config.json").is_file()


def test_a_private_model_needs_its_token(stub, tmp_path):
    token = "ms-stub-secret-token"
    stub.add_repo(REPO_ID, FILES, token=token)
    with pytest.raises(ConfigError, match="private and no token: set MODELSCOPE_API_TOKEN") as err:
        fetch(stub, tmp_path)
    assert err.value.exit_code == 2
    with pytest.raises(ConfigError, match="the token cannot see it"):
        fetch(stub, tmp_path, token="wrong")
    assert sorted(fetch(stub, tmp_path, token=token).files) == WANTED


@pytest.mark.parametrize("ref, message", [("Qwen/missing@master", "no such model"),
                                          (f"{REPO_ID}@no-such-branch", "no such branch, tag or commit")])
def test_unknown_models_and_revisions_are_one_clear_error(stub, tmp_path, ref, message):
    stub.add_repo(REPO_ID, FILES)
    with pytest.raises(ConfigError, match=message) as err:
        fetch(stub, tmp_path, ref=ref)
    assert err.value.exit_code == 2


def test_an_unreachable_endpoint_is_an_environment_problem(tmp_path):
    nobody = ModelScope(hubs.HubSettings("http://127.0.0.1:9", None, False))
    with pytest.raises(EnvironmentProblem, match="cannot reach http://127.0.0.1:9") as err:
        hubs.fetch(nobody, f"{REPO_ID}@master", tmp_path, print)
    assert err.value.exit_code == 7


def test_a_download_cut_short_is_resumed(stub, tmp_path, monkeypatch):
    import modelscope_hub._download as download

    monkeypatch.setattr(download, "DOWNLOAD_RETRY_MAX_DELAY_SECONDS", 0)  # no waiting between the SDK's retries
    commit = stub.add_repo(REPO_ID, FILES)
    stub.cut_after("model.safetensors", 1000, times=50)  # more than the SDK retries in one call
    with pytest.raises(EnvironmentProblem, match="broke"):
        fetch(stub, tmp_path)
    assert not (tmp_path / "models" / "modelscope" / "Qwen--tiny-embed" / commit).exists()  # never half there
    stub.cut_after("model.safetensors", 0, times=0)
    snapshot = fetch(stub, tmp_path)
    assert snapshot.files["model.safetensors"] == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    ranges = [rng for method, path, rng, _ in stub.requests if method == "GET" and "model.safetensors" in path]
    assert any(rng and rng.startswith("bytes=") and rng != "bytes=0-" for rng in ranges), ranges


def test_the_lock_pins_the_commit_and_refuses_changed_files(stub, tmp_path):
    first = stub.add_repo(REPO_ID, FILES)
    pinned = fetch(stub, tmp_path).lock_entry()
    stub.add_repo(REPO_ID, {**FILES, "merges.txt": b"b c\n"})
    assert fetch(stub, tmp_path, pinned=pinned).commit == first
    (tmp_path / "models" / "modelscope" / "Qwen--tiny-embed" / first / "merges.txt").write_bytes(b"changed\n")
    with pytest.raises(ConfigError, match="merges.txt differs from the locked sha256"):
        fetch(stub, tmp_path, pinned=pinned)
