"""hf:// sources through the real huggingface_hub against tests/hubstub.py, a local stand-in for the
Hugging Face Hub (these machines cannot reach the Hub): revision resolution, the files an engine
needs and no others, gated models and tokens, a download cut short, the lock's pins."""
from __future__ import annotations

import hashlib
import json

import pytest

from builder import hubs
from builder.errors import BuildError, ConfigError, EnvironmentProblem
from builder.hubs.huggingface import HuggingFace
from tests.hubstub import HubStub

REPO_ID = "org/tiny-embed"
FILES = {"config.json": b'{"model_type": "bert"}', "tokenizer.json": b'{"v": 1}', "vocab.txt": b"[PAD]\n[CLS]\n",
         "model.safetensors": bytes(range(256)) * 2048, "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": 1}',
         "README.md": b"---\nlicense: apache-2.0\n---\n# tiny\n",
         # what no engine reads: never downloaded
         "onnx/model.onnx": b"onnx" * 100, "pytorch_model.bin": b"pickle" * 100, "flax_model.msgpack": b"m"}
WANTED = sorted(set(FILES) - {"onnx/model.onnx", "pytorch_model.bin", "flax_model.msgpack"})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def stub(monkeypatch, tmp_path):
    # A fresh HF_HOME: no token saved by a login on this machine, no global cache to copy from.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with HubStub() as running:
        yield running


def client(stub, token=None, offline=False) -> HuggingFace:
    return HuggingFace(hubs.HubSettings(endpoint=stub.endpoint, token=token, offline=offline))


def fetch(stub, tmp_path, ref=f"{REPO_ID}@main", token=None, pinned=None, offline=False):
    return hubs.fetch(client(stub, token, offline), ref, tmp_path / "models", lambda line: None, pinned=pinned)


def test_a_branch_resolves_to_its_commit_and_only_what_engines_read_is_downloaded(stub, tmp_path):
    sha = stub.add_repo(REPO_ID, FILES)
    snapshot = fetch(stub, tmp_path)
    assert snapshot.commit == sha and snapshot.source == f"hf://{REPO_ID}@{sha}" and snapshot.revision == "main"
    assert snapshot.path == tmp_path / "models" / "hf" / "org--tiny-embed" / sha
    assert sorted(snapshot.files) == WANTED
    assert snapshot.files == {name: sha256(FILES[name]) for name in WANTED}
    for name in WANTED:
        assert (snapshot.path / name).read_bytes() == FILES[name]
    for skipped in ("onnx/model.onnx", "pytorch_model.bin", "flax_model.msgpack"):
        assert stub.resolve_count(skipped) == 0
    # No staging left, no library cache in the model dir (it would go into the image).
    assert not (snapshot.path / ".cache").exists() and not list(snapshot.path.parent.glob("*.partial"))
    assert hubs.card_license(snapshot.path) == "apache-2.0"
    assert snapshot.lock_entry() == {"repo": REPO_ID, "revision": "main", "sha": sha,
                                     "files": {name: sha256(FILES[name]) for name in WANTED}}


def test_a_cached_commit_is_not_downloaded_again_and_a_moved_branch_is_a_new_commit(stub, tmp_path):
    first = stub.add_repo(REPO_ID, FILES)
    fetch(stub, tmp_path)
    gets = stub.resolve_count("model.safetensors")
    assert fetch(stub, tmp_path).commit == first and stub.resolve_count("model.safetensors") == gets
    second = stub.add_repo(REPO_ID, {**FILES, "config.json": b'{"model_type": "bert", "v": 2}'})
    moved = fetch(stub, tmp_path)
    assert moved.commit == second != first and (moved.path / "config.json").read_bytes().endswith(b'"v": 2}')
    assert (tmp_path / "models" / "hf" / "org--tiny-embed" / first / "config.json").is_file()  # kept
    # A commit sha asks nothing of the Hub once cached.
    before = len(stub.requests)
    assert fetch(stub, tmp_path, ref=f"{REPO_ID}@{first}").commit == first and len(stub.requests) == before


def test_offline_uses_the_commit_the_branch_last_named(stub, tmp_path):
    sha = stub.add_repo(REPO_ID, FILES)
    fetch(stub, tmp_path)
    before = len(stub.requests)
    assert fetch(stub, tmp_path, offline=True).commit == sha and len(stub.requests) == before
    assert hubs.available(client(stub, offline=True), f"{REPO_ID}@main", tmp_path / "models")


def test_a_gated_model_needs_its_token_and_the_token_goes_nowhere_else(stub, tmp_path):
    token = "hf_stub_secret_token_value"
    stub.add_repo(REPO_ID, FILES, token=token)
    with pytest.raises(ConfigError, match="is gated .no token: set HF_TOKEN") as err:
        fetch(stub, tmp_path)
    assert err.value.exit_code == 2
    with pytest.raises(ConfigError, match="the token was refused"):
        fetch(stub, tmp_path, token="hf_wrong")
    logged: list[str] = []
    snapshot = hubs.fetch(client(stub, token), f"{REPO_ID}@main", tmp_path / "models", logged.append)
    assert sorted(snapshot.files) == WANTED and all(auth for *_, auth in stub.requests[-3:])
    assert token not in " ".join(logged)
    for path in (tmp_path / "models").rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("ref, message", [
    ("org/missing@main", "no such model"),
    (f"{REPO_ID}@no-such-branch", "no such branch, tag or commit"),
])
def test_unknown_models_and_revisions_are_one_clear_error(stub, tmp_path, ref, message):
    stub.add_repo(REPO_ID, FILES)
    with pytest.raises(ConfigError, match=message) as err:
        fetch(stub, tmp_path, ref=ref)
    assert err.value.exit_code == 2 and "Traceback" not in err.value.message


def test_a_hub_that_does_not_answer_is_an_environment_problem(tmp_path):
    nobody = HuggingFace(hubs.HubSettings("http://127.0.0.1:9", None, False))
    with pytest.raises(EnvironmentProblem, match="cannot reach http://127.0.0.1:9") as err:
        hubs.fetch(nobody, f"{REPO_ID}@main", tmp_path, print)
    assert err.value.exit_code == 7
    assert not hubs.reachable(nobody.settings, timeout=1)


def test_a_download_cut_short_keeps_what_finished_and_the_next_run_fetches_the_rest(stub, tmp_path):
    sha = stub.add_repo(REPO_ID, FILES)
    stub.cut_after("model.safetensors", 0, times=6)  # more cuts than the library retries in one call
    with pytest.raises(EnvironmentProblem, match="the connection broke"):
        fetch(stub, tmp_path)
    home = tmp_path / "models" / "hf" / "org--tiny-embed"
    assert not (home / sha).exists()  # never half there
    finished = {name: stub.resolve_count(name) for name in WANTED if name != "model.safetensors"}
    assert all(count == 1 for count in finished.values()), finished
    snapshot = fetch(stub, tmp_path)
    assert snapshot.files["model.safetensors"] == sha256(FILES["model.safetensors"])
    assert {name: stub.resolve_count(name) for name in finished} == finished  # not fetched again


def test_a_connection_cut_mid_file_is_resumed_with_a_range_request(stub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    stub.add_repo(REPO_ID, FILES)
    stub.cut_after("model.safetensors", 3 * 64 * 1024 + 100)
    snapshot = fetch(stub, tmp_path)
    assert snapshot.files["model.safetensors"] == sha256(FILES["model.safetensors"])
    ranges = [rng for method, path, rng, _ in stub.requests if method == "GET" and path.endswith("model.safetensors")]
    assert ranges == [None, f"bytes={3 * 64 * 1024}-"]


def test_a_file_that_does_not_match_the_hubs_hash_is_refused_and_removed(stub, tmp_path):
    sha = stub.add_repo(REPO_ID, FILES)
    stub.tamper(REPO_ID, sha, "model.safetensors", b"\0" * len(FILES["model.safetensors"]))
    with pytest.raises(BuildError, match="model.safetensors has sha256 .* the Hugging Face Hub says"):
        fetch(stub, tmp_path)
    home = tmp_path / "models" / "hf" / "org--tiny-embed"
    assert not (home / sha).exists() and not (home / f"{sha}.partial").exists()


def test_the_lock_pins_the_commit_and_refuses_changed_files(stub, tmp_path):
    first = stub.add_repo(REPO_ID, FILES)
    pinned = fetch(stub, tmp_path).lock_entry()
    stub.add_repo(REPO_ID, {**FILES, "vocab.txt": b"[PAD]\n"})  # main moves on
    assert fetch(stub, tmp_path, pinned=pinned).commit == first  # the locked build stays on the pinned commit
    # A mirror serving other bytes for the pinned commit (a config.json, which the Hub lists no sha256 for).
    stub.tamper(REPO_ID, first, "config.json", b'{"model_type": "evil"}')
    other_cache = tmp_path / "elsewhere"
    with pytest.raises(ConfigError, match="config.json differs from the locked sha256"):
        hubs.fetch(client(stub), f"{REPO_ID}@main", other_cache, print, pinned=pinned)


def test_a_repo_without_config_is_not_a_model(stub, tmp_path):
    stub.add_repo(REPO_ID, {"README.md": b"# datasets live elsewhere\n"})
    with pytest.raises(ConfigError, match="has no config.json"):
        fetch(stub, tmp_path)


def test_the_manifest_is_what_was_hashed(stub, tmp_path):
    snapshot_sha = stub.add_repo(REPO_ID, FILES)
    snapshot = fetch(stub, tmp_path)
    manifest = json.loads((snapshot.path / hubs.MANIFEST).read_text())
    assert manifest == snapshot.files and snapshot.commit == snapshot_sha


# --------------------------------------------------------------------------- the build's choice of model
def _builder(tmp_path, lock: dict | None, models: str = "auto"):
    from builder.build import Builder, BuildOptions
    from builder.matrix import load_matrix
    from builder.plan import make_plan
    from tests.conftest import REPO

    lock_file = None
    if lock is not None:
        lock_file = tmp_path / "mopt.lock.json"
        lock_file.write_text(json.dumps({"schema": 1, "runtimes": {}, **lock}))
    matrix = load_matrix(REPO / "matrix.yaml")
    variant = make_plan(matrix, ("qwen3-embed:cpu",)).variants[0]
    options = BuildOptions(state_dir=tmp_path / "state", templates=REPO / "templates", models=models,
                           lock_file=lock_file)
    builder = Builder(matrix, (variant,), options, log=lambda line: None, docker=object())
    recipe = matrix.image("qwen3-embed").recipe
    return builder, variant, recipe


def test_the_build_takes_the_real_model_when_its_hub_answers_and_the_substitute_when_not(stub, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
    builder, variant, recipe = _builder(tmp_path, None)
    client, choice, pinned = builder._choose_model(variant, recipe)
    assert not choice.substituted and choice.source.text == recipe.model.text and pinned is None
    assert client.settings.endpoint == stub.endpoint
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nobody there, nothing cached
    _, choice, _ = builder._choose_model(variant, recipe)
    assert choice.substituted and choice.source.text == "generate:tiny-qwen3?seed=0"


def test_a_locked_build_needs_the_hub_model_pinned(stub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
    builder, variant, recipe = _builder(tmp_path, {})
    with pytest.raises(ConfigError, match="is stale for qwen3-embed:cpu: it pins no commit for hf://Qwen/"):
        builder._choose_model(variant, recipe)
    pin = {"repo": "Qwen/Qwen3-Embedding-0.6B", "revision": "main", "sha": "c" * 40, "files": {}}
    builder, variant, recipe = _builder(tmp_path, {"models": {recipe.model.text: pin}})
    assert builder._choose_model(variant, recipe)[2] == pin
    # Where the real model cannot be had, the substitute needs no pin (and gets none).
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    builder, variant, recipe = _builder(tmp_path, {})
    _, choice, pinned = builder._choose_model(variant, recipe)
    assert choice.substituted and pinned is None


def test_mopt_lock_pins_a_hub_model_by_commit_and_file_hashes(stub, tmp_path, monkeypatch):
    from builder.lock import lock_model, read_lock, write_lock

    monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
    _, _, recipe = _builder(tmp_path, None)
    sha = stub.add_repo("Qwen/Qwen3-Embedding-0.6B", FILES)
    source, pin = lock_model(recipe, tmp_path / "models", lambda line: None)
    assert source == "hf://Qwen/Qwen3-Embedding-0.6B@main"
    assert pin == {"repo": "Qwen/Qwen3-Embedding-0.6B", "revision": "main", "sha": sha,
                   "files": {name: sha256(FILES[name]) for name in WANTED}}
    write_lock(tmp_path / "mopt.lock.json", {}, None, {source: pin})
    assert read_lock(tmp_path / "mopt.lock.json")["models"][source]["sha"] == sha
    from builder.matrix import load_matrix
    from tests.conftest import REPO

    minilm = load_matrix(REPO / "matrix.yaml").image("minilm-embed").recipe
    assert lock_model(minilm, tmp_path / "models", print) is None  # package: sources are not a hub's


def test_a_bundle_carries_the_cached_commit_to_a_site_that_builds_offline(stub, tmp_path):
    """mopt export copies the model out of the cache; mopt install copies it into the site's cache, which
    then serves the branch offline with no request to any hub."""
    sha = stub.add_repo(REPO_ID, FILES)
    fetch(stub, tmp_path)
    bundle = tmp_path / "bundle" / "models"
    copied = hubs.copy_out(tmp_path / "models", "hf", REPO_ID, sha, bundle)
    assert copied == bundle / "hf" / "org--tiny-embed" / sha
    assert (copied.parent / "refs" / "main").read_text().strip() == sha
    site = tmp_path / "site" / "models"
    logged: list[str] = []
    assert hubs.copy_in(bundle, site, logged.append) == [f"hf://{REPO_ID}@{sha}"]
    before = len(stub.requests)
    snapshot = hubs.fetch(client(stub, offline=True), f"{REPO_ID}@main", site, lambda line: None)
    assert snapshot.commit == sha and snapshot.files == {name: sha256(FILES[name]) for name in WANTED}
    assert len(stub.requests) == before and not list(site.rglob("*.import"))
    # Installing again keeps what is there; a site's own later resolution of the branch is not overwritten.
    site_ref = site / "hf" / "org--tiny-embed" / "refs" / "main"
    site_ref.write_text("f" * 40 + "\n")
    hubs.copy_in(bundle, site, logged.append)
    assert "already here" in logged[-1] and site_ref.read_text() == "f" * 40 + "\n"


def test_a_bundle_model_that_does_not_match_its_file_list_is_refused(stub, tmp_path):
    sha = stub.add_repo(REPO_ID, FILES)
    fetch(stub, tmp_path)
    bundle = tmp_path / "bundle"
    hubs.copy_out(tmp_path / "models", "hf", REPO_ID, sha, bundle)
    (bundle / "hf" / "org--tiny-embed" / sha / "config.json").write_text('{"model_type": "evil"}')
    with pytest.raises(ConfigError, match=f"hf://{REPO_ID}@{sha} does not match its own file list"):
        hubs.copy_in(bundle, tmp_path / "site", lambda line: None)
    assert not (tmp_path / "site" / "hf" / "org--tiny-embed" / sha).exists()
    with pytest.raises(ConfigError, match="is not in the model cache"):
        hubs.copy_out(tmp_path / "models", "hf", REPO_ID, "0" * 40, bundle)
