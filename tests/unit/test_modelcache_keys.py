"""The engine cache's pure parts (builder/runtime/modelcache.py), fast and without a compile: the key
holds every input an engine depends on and nothing else, --model-id/--cache-dir are checked, the model
digest is remembered per file listing and taken again when a file changes, and what killed compiles left
is swept. The compile, guard and lock paths: test_modelcache.py and tests/integration/test_model_runtime.py."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from builder.runtime import fingerprint, guard, modelcache
from builder.runtime.errors import UsageError
from builder.runtime.hostinfo import HostFacts
from builder.runtime.params import EngineParams

PARAMS = EngineParams(max_batch=2, max_seq_len=32, pooling="last")


@pytest.fixture
def model(tmp_path) -> Path:
    """A model directory as the cache sees it (files and their bytes; nothing is loaded)."""
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (m / "tokenizer.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"\0" * 64)
    return m


def test_the_key_holds_every_input_the_engine_depends_on(monkeypatch):
    facts = HostFacts(torch="2.13.0", cuda=None, tensorrt=None, sm=None, gpu_name=None, driver=None)
    gpu = HostFacts(torch="2.13.0", cuda="13.0", tensorrt=None, sm="90", gpu_name="NVIDIA H200", driver="580.1")
    base = modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX2")
    moved = replace(PARAMS, model_dir="/x", model_name="y")
    assert base == modelcache.cache_key("a" * 64, moved, "r", facts, 0.99, "AVX2")
    others = {
        "model": modelcache.cache_key("b" * 64, PARAMS, "r", facts, 0.99, "AVX2"),
        "params": modelcache.cache_key("a" * 64, replace(PARAMS, max_seq_len=64), "r", facts, 0.99, "AVX2"),
        "runtime": modelcache.cache_key("a" * 64, PARAMS, "s", facts, 0.99, "AVX2"),
        "torch": modelcache.cache_key("a" * 64, PARAMS, "r", replace(facts, torch="2.11.0"), 0.99, "AVX2"),
        "gate": modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.995, "AVX2"),
    }
    assert base not in others.values() and len(set(others.values())) == len(others)
    cuda = replace(PARAMS, device="cuda", precision="bf16")
    on_gpu = modelcache.cache_key("a" * 64, cuda, "r", gpu, 0.99, "AVX2")
    for change in ({"sm": "100"}, {"gpu_name": "NVIDIA H100"}, {"driver": "590.2"}, {"cuda": "12.8"}):
        assert modelcache.cache_key("a" * 64, cuda, "r", replace(gpu, **change), 0.99, "AVX2") != on_gpu, change
    assert modelcache.cache_key("a" * 64, cuda, "r", gpu, 0.99, "AVX512") == on_gpu  # a GPU engine: not the CPU's
    # a cpu engine does not depend on the GPU or its driver
    elsewhere = replace(facts, driver="580.1", sm="90")
    assert modelcache.cache_key("a" * 64, PARAMS, "r", elsewhere, 0.99, "AVX2") == base
    # ... but on the CPU's instruction set
    assert modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX512") != modelcache.cache_key(
        "a" * 64, PARAMS, "r", facts, 0.99, "AVX2")
    assert modelcache.cpu_capability()
    # each compile-time switch that changes the engine; set to the same value, the same key
    switched = {name: modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX2", {name: "0"})
                for name in modelcache.KEYED_SWITCHES}
    assert base not in switched.values() and len(set(switched.values())) == len(switched)
    assert modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX2", {"MOPT_FP8_SCALES": "static"}) != (
        modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX2", {"MOPT_FP8_SCALES": "dynamic"}))
    assert modelcache.cache_key("a" * 64, PARAMS, "r", facts, 0.99, "AVX2", {}) == base
    first = modelcache.runtime_identity()
    monkeypatch.setenv(modelcache.RUNTIME_ID_ENV, "sha256:other-image")
    assert modelcache.runtime_identity() != first


def test_what_a_killed_compile_left_is_swept_unless_its_compile_still_runs(tmp_path):
    import fcntl

    engines = tmp_path / "engines"
    engines.mkdir()
    for key in ("a" * 32, "b" * 32, "c" * 32):
        (engines / f".tmp-{key}-41").mkdir()
        (engines / f".tmp-{key}-41" / "part").write_text("x")
        (engines / f".tmp-{key}-41.params.json").write_text("{}")
        (engines / f".refused-{key}-9f").mkdir()
    running = os.open(engines / f"{'c' * 32}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(running, fcntl.LOCK_EX)  # another process compiles c now
    try:
        modelcache._sweep(engines, "a" * 32)
    finally:
        os.close(running)
    left = sorted(p.name for p in engines.iterdir() if not p.name.endswith(".lock"))
    assert left == [f".refused-{'c' * 32}-9f", f".tmp-{'c' * 32}-41", f".tmp-{'c' * 32}-41.params.json"]
    modelcache._sweep(engines, "b" * 32)  # c's lock is free now
    assert [p.name for p in engines.iterdir() if not p.name.endswith(".lock")] == []


def test_the_digest_is_remembered_per_listing_and_taken_again_on_a_change(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    hashed = []
    real = fingerprint.model_digest
    monkeypatch.setattr(fingerprint, "model_digest", lambda d: hashed.append(d) or real(d))
    first = modelcache.model_digest(model, cache)
    assert first == real(model) and len(hashed) == 1
    assert modelcache.model_digest(model, cache) == first and len(hashed) == 1, "the memo answers"
    assert modelcache.model_digest(model, None) == first and len(hashed) == 2, "no cache: hashed"
    (model / "model.safetensors").write_bytes(b"\1" * 64)  # same size, new content (and ctime)
    changed = modelcache.model_digest(model, cache)
    assert changed != first and changed == real(model) and len(hashed) == 3
    (model / "extra.txt").write_text("x")
    assert modelcache.model_digest(model, cache) == real(model) != changed
    (model / ".cache").mkdir()
    (model / ".cache" / "hub.lock").write_text("bookkeeping")  # huggingface_hub's, not the model's
    before = len(hashed)
    modelcache.model_digest(model, cache)
    assert len(hashed) == before, "the hub's bookkeeping is not part of the listing"
    memo = next((cache / "digests").glob("*.json"))
    memo.write_text(json.dumps({"model_digest": "short"}))  # a broken memo is hashed again, not trusted
    assert modelcache.model_digest(model, cache) == real(model)


def test_the_listing_sees_names_sizes_and_times(model):
    first = modelcache._stat_listing(model)
    assert modelcache._stat_listing(model) == first
    os.utime(model / "config.json", ns=(1, 1))
    assert modelcache._stat_listing(model) != first
    second = modelcache._stat_listing(model)
    (model / "config.json").rename(model / "config2.json")
    assert modelcache._stat_listing(model) != second


def test_a_linked_subdirectory_is_part_of_the_digest_and_the_listing(model, tmp_path):
    """A subdirectory may be a link (1_Pooling/ -> a shared copy): its files are read by the loaders, so a
    change there, or the link pointed elsewhere, must compile again."""
    for name, mode in (("pool_a", "mean"), ("pool_b", "cls")):
        (model / "shared" / name).mkdir(parents=True)
        (model / "shared" / name / "config.json").write_text(json.dumps({"pooling_mode": mode}))
    (model / "1_Pooling").symlink_to("shared/pool_a", target_is_directory=True)
    assert "1_Pooling/config.json" in fingerprint.tree_files(model)
    digest, listing = fingerprint.model_digest(model), modelcache._stat_listing(model)
    (model / "1_Pooling").unlink()
    (model / "1_Pooling").symlink_to("shared/pool_b", target_is_directory=True)
    assert fingerprint.model_digest(model) != digest and modelcache._stat_listing(model) != listing
    # a linked file (a Hugging Face snapshot's blobs) is read through its link
    blob = tmp_path / "blob"
    blob.write_bytes(b"weights")
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").symlink_to(blob)
    before = fingerprint.model_digest(model)
    blob.write_bytes(b"other weights")
    assert fingerprint.model_digest(model) != before


def test_a_link_out_of_the_model_or_in_a_loop_is_refused(model, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (model / "extra").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UsageError, match="outside .*copy or mount that directory"):
        fingerprint.model_digest(model)
    with pytest.raises(UsageError, match="outside"):
        modelcache._stat_listing(model)
    (model / "extra").unlink()
    (model / "sub").mkdir()
    (model / "sub" / "up").symlink_to("..", target_is_directory=True)
    with pytest.raises(UsageError, match="a loop"):
        fingerprint.model_digest(model)
    (model / "sub" / "up").unlink()
    (model / "sub" / "dangling").symlink_to(tmp_path / "gone")  # a broken link is no file: left out
    assert fingerprint.tree_files(model) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_model_source_resolves_the_parameters_and_paths(model, tmp_path):
    got = modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, {"pooling"}, min_cosine=0.995)
    assert (got.model_dir, got.cache_dir) == (str(model.resolve()), str((tmp_path / "c").resolve()))
    assert (got.params.model_dir, got.params.model_name, got.min_cosine) == (str(model.resolve()), "model", 0.995)
    named = modelcache.model_source(str(model), str(tmp_path / "c"), replace(PARAMS, model_name="bge"), set(),
                                    min_cosine=0.99)
    assert named.params.model_name == "bge"
    with pytest.raises(UsageError, match="--min-cosine must be in -1..1"):
        modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=1.5)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        modelcache.model_source(str(model), str(tmp_path / "file"), PARAMS, set(), min_cosine=0.99)
    for overlap in (model / "cache", tmp_path):
        with pytest.raises(UsageError, match="overlap"):
            modelcache.model_source(str(model), str(overlap), PARAMS, set(), min_cosine=0.99)
    (model / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match="no tokenizer.json"):
        modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=0.99)


@pytest.mark.parametrize(("model_id", "message"), [("hf://Qwen/Qwen3-Embedding-0.6B", "only a mounted model"),
                                                   ("modelscope://x/y", "only a mounted model"),
                                                   ("/no/such/dir", "not a directory")])
def test_model_ids_that_are_not_a_mounted_directory(tmp_path, model_id, message):
    with pytest.raises(UsageError, match=message):
        modelcache.model_source(model_id, str(tmp_path), PARAMS, set(), min_cosine=0.99)


def test_a_cache_dir_is_required(model):
    with pytest.raises(UsageError, match="needs --cache-dir"):
        modelcache.model_source(str(model), None, PARAMS, set(), min_cosine=0.99)


def test_the_key_is_stable_for_the_same_inputs():
    """Keys are what every volume's entries are found by: a change of their recipe (a renamed field, another
    hash) orphans every warmed cache, so it must be deliberate (CACHE_FORMAT, and this test updated)."""
    cpu = HostFacts(torch="2.13.0", cuda=None, tensorrt=None, sm=None, gpu_name=None, driver=None)
    gpu = HostFacts(torch="2.13.0", cuda="13.0", tensorrt=None, sm="90", gpu_name="NVIDIA H200", driver="580.1")
    assert modelcache.cache_key("a" * 64, PARAMS, "r", cpu, 0.99, "AVX2") == "42d25e1add09906ebf71542cb67e6b1f"
    cuda = replace(PARAMS, device="cuda", precision="bf16")
    assert modelcache.cache_key("a" * 64, cuda, "r", gpu, 0.99, "AVX2") == "23e93f6955042a31c29964d035c33d47"


def test_a_memo_without_a_digest_is_hashed_again(model, tmp_path):
    cache = tmp_path / "cache"
    first = modelcache.model_digest(model, cache)
    memo = next((cache / "digests").glob("*.json"))
    for broken in ({"other": 1}, ["x"], {"model_digest": 7}, {"model_digest": "short"}, "not json"):
        memo.write_text(broken if isinstance(broken, str) else json.dumps(broken))
        assert modelcache.model_digest(model, cache) == first
        assert json.loads(memo.read_text()) == {"model_digest": first}, "written again"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")  # a cache that cannot be written: hashed, not an error
    assert modelcache.model_digest(model, a_file) == first


def test_the_models_own_pooling_decides_unless_given(model, tmp_path):
    (model / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                     "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    taken = modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=0.99)
    assert taken.params.pooling == "cls"
    with pytest.raises(UsageError, match="pooling last contradicts"):
        modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, {"pooling"}, min_cosine=0.99)
    forced = modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, {"pooling"}, min_cosine=0.99,
                                     force_pooling=True)
    assert forced.params.pooling == "last"



def test_usage_errors_word_for_word(model, tmp_path):
    def message(model_id, cache, cosine=0.99):
        with pytest.raises(UsageError) as err:
            modelcache.model_source(model_id, cache, PARAMS, set(), min_cosine=cosine)
        return err.value.message

    assert message("hf://a/b", "c") == ("--model-id hf://a/b: only a mounted model directory is supported by this "
                                        "runtime; download the model on the host (or `mopt warm` there) and mount it "
                                        "read-only")
    assert message(str(model), None) == ("--model-id needs --cache-dir (MOPT_CACHE_DIR): where the compiled engine is "
                                         "kept")
    assert message(str(model), str(model / "c")) == (
        f"--cache-dir {model / 'c'} and --model-id {model} overlap: the cache must be outside the model directory "
        "(its files would change the model's digest) and hold no model")
    for cosine in (-1.0001, 1.0001):
        assert message(str(model), str(tmp_path / "c"), cosine) == f"--min-cosine must be in -1..1, got {cosine}"
    for cosine in (-1.0, 1.0):  # the bounds themselves are allowed
        assert modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=cosine)
    (model / "tokenizer.json").unlink()
    assert message(str(model), str(tmp_path / "c")) == (
        f"--model-id {model}: no tokenizer.json there (expected a Hugging Face model dir with a fast tokenizer)")


def test_reference_texts_are_carried_as_a_tuple(model, tmp_path):
    given = modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=0.99,
                                    reference_texts=["one", "two"])
    assert given.reference_texts == ("one", "two")
    assert modelcache.model_source(str(model), str(tmp_path / "c"), PARAMS, set(), min_cosine=0.99,
                                   reference_texts=[]).reference_texts is None


def test_remove_takes_files_dirs_and_what_is_already_gone(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "f").write_text("x")
    for name in ("d", "f", "gone"):
        modelcache._remove(tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def fake_entry(engines: Path, name: str, digest: str, params: EngineParams, facts: HostFacts,
               mtime: int = 0) -> Path:
    """An entry as a compile writes it (engine files, engine.json with the cache key), its engine a dummy."""
    entry = engines / name
    (entry / "engine").mkdir(parents=True)
    (entry / "engine" / "model.pt2").write_bytes(b"a dummy engine")
    files = fingerprint.file_hashes(entry / "engine")
    fingerprint.write(entry, {
        "backend": params.backend, "backend_version": facts.torch, "torch": facts.torch, "cuda": facts.cuda,
        "tensorrt": facts.tensorrt, "device": params.device, "target_sm": None, "gpu_name": None, "driver": None,
        "engine_files": files, "engine_sha256": files["model.pt2"], "artifact": "model.pt2",
        "model_digest": digest, "params": params.to_dict(), "image": None, "cache": {"key": name}})
    if mtime:
        os.utime(entry / "engine.json", ns=(mtime, mtime))
    return entry


CPU_FACTS = HostFacts(torch="2.13.0", cuda=None, tensorrt=None, sm=None, gpu_name=None, driver=None)


def test_the_entries_hashed_ahead_are_this_models_with_these_parameters_newest_first(tmp_path):
    engines, digest = tmp_path / "engines", "d" * 64
    params = replace(PARAMS, model_dir="/models/a")
    old = fake_entry(engines, "k-old", digest, params, CPU_FACTS, mtime=10**18)
    newer = fake_entry(engines, "k-newer", digest, replace(params, model_dir="/elsewhere"), CPU_FACTS, 3 * 10**18)
    newest = fake_entry(engines, "k-newest", digest, params, replace(CPU_FACTS, torch="2.12.0"), 4 * 10**18)
    assert modelcache._likely_entries(engines, digest, params) == [newest, newer]  # AHEAD_ENTRIES, newest first
    (newest / "engine.json").unlink()
    (newer / "engine.json").write_text("{")
    assert modelcache._likely_entries(engines, digest, params) == [old]
    fake_entry(engines, "k-other-model", "e" * 64, params, CPU_FACTS, 5 * 10**18)
    fake_entry(engines, "k-other-params", digest, replace(params, max_seq_len=64), CPU_FACTS, 5 * 10**18)
    misnamed = fake_entry(engines, "k-misnamed", digest, params, CPU_FACTS, 5 * 10**18)
    misnamed.rename(engines / "k-renamed")  # its engine.json records another key than its name
    fake_entry(engines, ".tmp-k-x", digest, params, CPU_FACTS, 5 * 10**18)
    (engines / "k-file").write_text("not an entry")
    assert modelcache._likely_entries(engines, digest, params) == [old]
    assert modelcache._likely_entries(tmp_path / "absent", digest, params) == []


def test_a_hit_is_hashed_while_the_host_facts_are_read_and_not_again(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    source = modelcache.model_source(str(model), str(cache), PARAMS, set(), min_cosine=0.99)
    digest = modelcache.model_digest(model, cache)
    key = modelcache.cache_key(digest, source.params, modelcache.runtime_identity(), CPU_FACTS,
                               source.min_cosine, modelcache.cpu_capability())
    entry = fake_entry(cache / "engines", key, digest, source.params, CPU_FACTS)
    order = []
    hash_file = fingerprint.sha256_file
    monkeypatch.setattr(fingerprint, "sha256_file", lambda path: order.append("hash") or hash_file(path))
    monkeypatch.setattr("builder.runtime.hostinfo.host_facts", lambda: order.append("facts") or CPU_FACTS)
    result = modelcache.resolve_cached(source)
    assert (result.outcome, result.engine_dir) == ("hit", entry)
    assert order.count("hash") == 1 and "integrity" not in guard.LAST_CHECK_SECONDS  # ahead only: the guard took it
    (entry / "engine" / "model.pt2").write_bytes(b"a dummy engine!")  # tampered: the ahead hash sees it
    problem, _ = modelcache._entry_problem(entry, key, digest, CPU_FACTS, guard.integrity_ahead(entry))
    assert problem.endswith("model.pt2 sha256 differs from engine.json; rebuild or re-pull the image")


def test_entries_that_are_not_this_models_do_not_end_the_search(tmp_path):
    class Ordered(type(tmp_path)):  # the listing in name order: the entries that do not count come first
        def iterdir(self):
            return iter(sorted(super().iterdir()))

    engines, digest = Ordered(tmp_path / "engines"), "d" * 64
    good = fake_entry(engines, "z-good", digest, PARAMS, CPU_FACTS)
    fake_entry(engines, ".a-tmp", digest, PARAMS, CPU_FACTS)
    (engines / "b-file").write_text("not an entry")
    (engines / "c-broken").mkdir()
    (engines / "c-broken" / "engine.json").write_text("{")
    assert modelcache._likely_entries(engines, digest, PARAMS) == [good]


def test_the_keyed_switches_are_the_documented_compile_time_variables():
    """A compile-time variable added to docs/environment.yaml must be keyed or said not to change the engine:
    otherwise an engine compiled under one setting is served after a restart under another."""
    import yaml

    documented = yaml.safe_load((Path(__file__).resolve().parents[2] / "docs" / "environment.yaml").read_text())
    compile_time = {name for name, entry in documented.items() if entry["where"] == "compile"}
    assert set(modelcache.KEYED_SWITCHES) | set(modelcache.UNKEYED_SWITCHES) == compile_time
    assert not set(modelcache.KEYED_SWITCHES) & set(modelcache.UNKEYED_SWITCHES)
    environ = {"MOPT_FP8_SCALES": "static", "MOPT_TRT_TIMING_CACHE": "/t", "MOPT_LOG_LEVEL": "INFO", "HOME": "/"}
    assert modelcache.compile_switches(environ) == {"MOPT_FP8_SCALES": "static"}
    assert modelcache.compile_switches({}) == {}


def test_a_start_finds_the_entry_compiled_under_its_switches(model, tmp_path, monkeypatch):
    """serve --model-id keys its entry on the compile-time variables of its environment: the entry made
    with MOPT_FP8_SCALES=static is the one a start with that setting loads (without it, another key)."""
    cache = tmp_path / "cache"
    source = modelcache.model_source(str(model), str(cache), PARAMS, set(), min_cosine=0.99)
    digest = modelcache.model_digest(model, cache)
    args = (digest, source.params, modelcache.runtime_identity(), CPU_FACTS, source.min_cosine,
            modelcache.cpu_capability())
    static = modelcache.cache_key(*args, {"MOPT_FP8_SCALES": "static"})
    assert static != modelcache.cache_key(*args)
    entry = fake_entry(cache / "engines", static, digest, source.params, CPU_FACTS)
    monkeypatch.setenv("MOPT_FP8_SCALES", "static")
    monkeypatch.setattr("builder.runtime.hostinfo.host_facts", lambda: CPU_FACTS)
    result = modelcache.resolve_cached(source)
    assert (result.outcome, result.engine_dir, result.key) == ("hit", entry, static)
