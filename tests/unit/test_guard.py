"""The start-up guard on fake engine dirs and fake host facts (no compile): integrity, every
environment difference (same-major sm included), the fitting-tag advice and resolve()'s opt-in."""
from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")

from builder.runtime import fingerprint, guard  # noqa: E402
from builder.runtime.backends import BACKENDS, BackendInfo  # noqa: E402
from builder.runtime.errors import GuardError  # noqa: E402
from builder.runtime.hostinfo import HostFacts  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402

pytestmark = pytest.mark.runtime

TORCH = "2.11.0+cu128"
IMAGE = {"repository": "mopt/e", "tag_template": "cu{cuda}-sm{sm}",
         "tags_by_sm": {"80": "cu128-sm80", "86": "cu128-sm86", "90": "cu128-sm90"}}


def host(sm: str | None = "86", name: str | None = "NVIDIA A10G", **over) -> HostFacts:
    facts = {"torch": TORCH, "cuda": "12.8", "tensorrt": None, "sm": sm, "gpu_name": name, "driver": "580.1"}
    return HostFacts(**{**facts, **over})


A10G = host()
A100 = host("80", "NVIDIA A100")
NO_GPU = host(None, None, driver=None)


def make_engine(tmp_path: Path, *, sm: str | int | None = "86", name: str | None = "NVIDIA A10G",
                device: str = "cuda", image=IMAGE, **over) -> Path:
    """An engine dir as a compile on an sm_<sm> host would write it, with a dummy artifact."""
    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "model.pt2").write_bytes(b"not a real engine")
    (out / "engine" / "tokenizer.json").write_text("{}")
    files = fingerprint.file_hashes(out / "engine")
    data = {"backend": "torch-aot", "backend_version": TORCH, "torch": TORCH, "cuda": "12.8", "tensorrt": None,
            "device": device, "target_sm": sm, "gpu_name": name, "driver": "580.1", "engine_files": files,
            "engine_sha256": files["model.pt2"], "artifact": "model.pt2", "model_digest": "0" * 64,
            "image": image, "params": EngineParams(device=device).to_dict()}
    fingerprint.write(out, {**data, **over})
    return out


_DROP = "__drop__"  # edit(): remove the field


def edit(out: Path, **changes) -> None:
    data = json.loads((out / "engine.json").read_text())
    data.update(changes)
    for key in [k for k, v in changes.items() if v is _DROP]:
        del data[key]
    (out / "engine.json").write_text(json.dumps(data))


def refusal(out: Path, facts: HostFacts) -> str:
    with pytest.raises(guard.EngineMismatch) as exc:
        guard.check(out, facts)
    assert exc.value.exit_code == 3
    return str(exc.value)


# --- the GPU architecture -------------------------------------------------------------------------

def test_same_sm_passes(tmp_path):
    out = make_engine(tmp_path)
    data = guard.check(out, A10G)
    assert data == fingerprint.read(out)


@pytest.mark.parametrize("engine_sm, engine_name, facts, message", [
    # Same major (8.x): an sm_80 engine is not an sm_86 engine, and the reverse.
    ("80", "NVIDIA A100", A10G, "engine built for sm_80 (NVIDIA A100) but this host's GPU is sm_86 (NVIDIA A10G): "
                                "pull mopt/e:cu128-sm86"),
    ("86", "NVIDIA A10G", A100, "engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_80 (NVIDIA A100): "
                                "pull mopt/e:cu128-sm80"),
    # No GPU name recorded or reported: the bare sm label.
    ("80", None, host("86", None), "engine built for sm_80 but this host's GPU is sm_86: pull mopt/e:cu128-sm86"),
    ("86", "NVIDIA A10G", NO_GPU, "engine built for sm_86 (NVIDIA A10G) but this host has no usable CUDA GPU: "
                                  "no published tag of mopt/e fits a host without a CUDA GPU "
                                  "(published: sm_80, sm_86, sm_90)"),
])
def test_other_sm_is_refused(tmp_path, engine_sm, engine_name, facts, message):
    assert refusal(make_engine(tmp_path, sm=engine_sm, name=engine_name), facts) == message


def test_target_sm_recorded_as_a_number_still_matches(tmp_path):
    assert guard.check(make_engine(tmp_path, sm=86), A10G)["target_sm"] == 86


def test_cpu_engine_ignores_the_gpu(tmp_path):
    out = make_engine(tmp_path, sm=None, name=None, device="cpu")
    for facts in (A10G, A100, NO_GPU):
        assert guard.check(out, facts)["device"] == "cpu"


# --- the software stack ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("torch", "2.12.0+cu130", f"engine built with torch {TORCH} but this host runs torch 2.12.0+cu130"),
    ("cuda", "13.0", "engine built with CUDA 12.8 but this host's torch has CUDA 13.0"),
    ("cuda", None, "engine built with CUDA 12.8 but this host's torch has CUDA None"),
    ("tensorrt", "10.9.0", "engine built with TensorRT None but this host has 10.9.0"),
])
def test_one_version_differs(tmp_path, field, value, message):
    facts = host(**{field: value})
    assert refusal(make_engine(tmp_path), facts) == f"{message}: pull mopt/e:cu128-sm86"


def test_every_difference_is_named_in_order(tmp_path):
    facts = host("90", "NVIDIA H200", torch="2.12.0", cuda="13.0", tensorrt="10.9.0")
    assert refusal(make_engine(tmp_path), facts) == (
        "engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_90 (NVIDIA H200); "
        f"engine built with torch {TORCH} but this host runs torch 2.12.0; "
        "engine built with CUDA 12.8 but this host's torch has CUDA 13.0; "
        "engine built with TensorRT None but this host has 10.9.0: pull mopt/e:cu128-sm90")


def test_torch_backends_version_is_torchs(tmp_path):
    # torch-aot's backend_version is torch's: compared against the host facts, not the running torch.
    assert guard.check(make_engine(tmp_path, backend_version="anything"), A10G)["backend"] == "torch-aot"


@pytest.fixture
def fake_backend(monkeypatch):
    """A backend whose version is not torch's (as tensorrt or vllm), without installing either."""
    backend = types.SimpleNamespace(version=lambda: "1.2.0", prepared=[], prepare=lambda device: None)
    real = guard.get_backend
    monkeypatch.setattr(guard, "get_backend", lambda name: backend if name == "fake" else real(name))
    monkeypatch.setitem(BACKENDS, "fake", BackendInfo(module="fake", own_server=False, version_is_torch=False,
                                                      prepares=True))
    return backend


def test_backend_version_differs(tmp_path, fake_backend):
    out = make_engine(tmp_path, backend="fake", backend_version="1.1.0")
    assert refusal(out, A10G) == "engine built with fake 1.1.0 but this host has 1.2.0: pull mopt/e:cu128-sm86"
    edit(out, backend_version="1.2.0")
    assert guard.check(out, A10G)["backend_version"] == "1.2.0"


def test_backend_prepare_runs_on_the_engine_device_and_is_timed(tmp_path, fake_backend):
    def prepare(device):
        fake_backend.prepared.append(device)
        time.sleep(0.03)

    fake_backend.prepare = prepare
    guard.check(make_engine(tmp_path, backend="fake", backend_version="1.2.0"), A10G)
    assert fake_backend.prepared == ["cuda"]
    assert set(guard.LAST_CHECK_SECONDS) == {"integrity", "backend_prepare"}
    assert 0.03 <= guard.LAST_CHECK_SECONDS["backend_prepare"] < 2
    assert 0 <= guard.LAST_CHECK_SECONDS["integrity"] < 2


def test_host_facts_are_read_when_not_given(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(guard, "host_facts", lambda: calls.append(1) or A100)
    out = make_engine(tmp_path)
    assert refusal_without_facts(out).startswith("engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_80")
    assert calls == [1]
    assert set(guard.LAST_CHECK_SECONDS) == {"integrity", "host_facts"}  # cleared: no key of an earlier check
    assert all(0 <= v < 60 for v in guard.LAST_CHECK_SECONDS.values())


def refusal_without_facts(out: Path) -> str:
    with pytest.raises(guard.EngineMismatch) as exc:
        guard.check(out)
    return str(exc.value)


# --- integrity ------------------------------------------------------------------------------------

def integrity_error(out: Path) -> str:
    with pytest.raises(GuardError) as exc:
        guard.check(out, A10G)
    assert type(exc.value) is GuardError  # not recompilable
    assert exc.value.exit_code == 3
    return str(exc.value)


def test_missing_file(tmp_path):
    out = make_engine(tmp_path)
    (out / "engine" / "tokenizer.json").unlink()
    assert integrity_error(out) == (f"engine in {out / 'engine'} failed its integrity check: tokenizer.json is "
                                    "missing; rebuild or re-pull the image")


def test_every_file_missing(tmp_path):
    out = make_engine(tmp_path)
    for name in ("model.pt2", "tokenizer.json"):
        (out / "engine" / name).unlink()
    assert integrity_error(out) == (f"engine in {out / 'engine'} failed its integrity check: model.pt2 is missing; "
                                    "tokenizer.json is missing; rebuild or re-pull the image")


def test_changed_file(tmp_path):
    out = make_engine(tmp_path)
    (out / "engine" / "model.pt2").write_bytes(b"not a real engine!")
    assert integrity_error(out) == (f"engine in {out / 'engine'} failed its integrity check: model.pt2 sha256 "
                                    "differs from engine.json; rebuild or re-pull the image")


def test_engine_sha256_not_the_artifacts(tmp_path):
    out = make_engine(tmp_path)
    edit(out, engine_sha256="0" * 64)
    assert integrity_error(out) == (f"engine in {out / 'engine'} failed its integrity check: engine_sha256 in "
                                    "engine.json does not match the recorded sha256 of model.pt2; "
                                    "rebuild or re-pull the image")


def test_all_integrity_failures_together(tmp_path):
    out = make_engine(tmp_path)
    (out / "engine" / "model.pt2").write_bytes(b"x")
    (out / "engine" / "tokenizer.json").unlink()
    edit(out, engine_sha256="0" * 64)
    assert integrity_error(out) == (
        f"engine in {out / 'engine'} failed its integrity check: tokenizer.json is missing; model.pt2 sha256 "
        "differs from engine.json; engine_sha256 in engine.json does not match the recorded sha256 of model.pt2; "
        "rebuild or re-pull the image")


def test_integrity_is_checked_before_the_environment(tmp_path):
    out = make_engine(tmp_path)
    (out / "engine" / "model.pt2").write_bytes(b"x")
    assert "failed its integrity check" in integrity_error_on(out, A100)


def integrity_error_on(out: Path, facts: HostFacts) -> str:
    with pytest.raises(GuardError) as exc:
        guard.check(out, facts)
    assert not isinstance(exc.value, guard.EngineMismatch)
    return str(exc.value)


def test_engine_json_without_artifact_field(tmp_path):
    # Older fingerprints name no artifact: the per-file hashes are the whole check.
    out = make_engine(tmp_path)
    edit(out, artifact=_DROP, engine_sha256="not compared")
    assert guard.check(out, A10G)["engine_sha256"] == "not compared"


# --- the advice -----------------------------------------------------------------------------------

NO_INFO = ("no image info in engine.json to name a fitting tag; recompile on this host (compile) or set "
           "MOPT_RECOMPILE_ON_MISMATCH=1 and MOPT_ENGINE_CACHE=/path")


@pytest.mark.parametrize("image, facts, advice", [
    (None, A10G, NO_INFO),
    ({}, A10G, NO_INFO),
    ({"repository": "", "tags_by_sm": {"86": "x"}}, A10G, NO_INFO),
    ({"repository": "r", "tags_by_sm": {"86": "cu128-sm86"}}, A10G, "pull r:cu128-sm86"),
    ({"repository": "r", "tags_by_sm": {"cpu": "cpu", "90": "sm90"}}, NO_GPU, "pull r:cpu"),
    ({"repository": "r", "tags_by_sm": {"90": "sm90", "cpu": "cpu", "80": "sm80"}}, A10G,
     "no published tag of r fits sm_86 (published: sm_80, sm_90, cpu)"),
    ({"repository": "r", "tags_by_sm": {"90": "sm90"}}, NO_GPU,
     "no published tag of r fits a host without a CUDA GPU (published: sm_90)"),
    # The list wins over the template: a host it lacks gets no guessed tag.
    ({"repository": "r", "tags_by_sm": {"90": "sm90"}, "tag_template": "cu{cuda}-sm{sm}"}, A10G,
     "no published tag of r fits sm_86 (published: sm_90)"),
    ({"repository": "r", "tags_by_sm": None, "tag_template": "cu{cuda}-sm{sm}"}, A10G,
     "no list of published tags; the tag for this host would be r:cu128-sm86 if it exists"),
    ({"repository": "r", "tags_by_sm": {}, "tag_template": "cu{cuda}-sm{sm}"}, host(cuda="13.0"),
     "no list of published tags; the tag for this host would be r:cu130-sm86 if it exists"),
    ({"repository": "r", "tag_template": "cu{cuda}-sm{sm}"}, NO_GPU,
     "no published tag of r is known to fit a host without a CUDA GPU"),
    ({"repository": "r", "tag_template": "cu{cuda}-sm{sm}"}, host(cuda=None),
     "no published tag of r is known to fit sm_86"),
    ({"repository": "r", "tag_template": "{flavour}"}, A10G, "no published tag of r is known to fit sm_86"),
    ({"repository": "r", "tag_template": "{0}"}, A10G, "no published tag of r is known to fit sm_86"),
    ({"repository": "r", "tag_template": "sm{sm"}, A10G, "no published tag of r is known to fit sm_86"),
    ({"repository": "r", "tag_template": ""}, A10G, "no published tag of r is known to fit sm_86"),
    ({"repository": "r"}, A10G, "no published tag of r is known to fit sm_86"),
])
def test_fitting_tag(image, facts, advice):
    assert guard.fitting_tag(image, facts) == advice


def test_refusal_without_image_info(tmp_path):
    out = make_engine(tmp_path, image=None)
    assert refusal(out, A100) == ("engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_80 "
                                  f"(NVIDIA A100): {NO_INFO}")


# --- resolve(): the opt-in recompile --------------------------------------------------------------

def test_resolve_returns_the_given_dir_when_it_fits(tmp_path):
    out = make_engine(tmp_path)
    engine_dir, data = guard.resolve(str(out), env={}, facts=A10G)
    assert engine_dir == out and isinstance(engine_dir, Path)
    assert data["target_sm"] == "86"


@pytest.mark.parametrize("env", [{}, {guard.ENV_RECOMPILE: "0"}, {guard.ENV_RECOMPILE: "true"},
                                 {guard.ENV_CACHE: "/cache"}])
def test_resolve_without_opt_in_refuses(tmp_path, monkeypatch, env):
    monkeypatch.setattr(guard, "_recompile", lambda *a: pytest.fail("recompiled without opt-in"))
    with pytest.raises(guard.EngineMismatch) as exc:
        guard.resolve(make_engine(tmp_path), env=env, facts=A100)
    assert str(exc.value) == ("engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_80 (NVIDIA A100): "
                              "pull mopt/e:cu128-sm80")


@pytest.mark.parametrize("cache", [None, ""])
def test_resolve_opt_in_needs_a_cache(tmp_path, monkeypatch, cache):
    monkeypatch.setattr(guard, "_recompile", lambda *a: pytest.fail("recompiled without a cache"))
    env = {guard.ENV_RECOMPILE: "1"} if cache is None else {guard.ENV_RECOMPILE: "1", guard.ENV_CACHE: cache}
    with pytest.raises(GuardError) as exc:
        guard.resolve(make_engine(tmp_path), env=env, facts=A100)
    assert type(exc.value) is GuardError and exc.value.exit_code == 3
    assert str(exc.value) == ("engine built for sm_86 (NVIDIA A10G) but this host's GPU is sm_80 (NVIDIA A100): "
                              "pull mopt/e:cu128-sm80; MOPT_RECOMPILE_ON_MISMATCH=1 also needs "
                              "MOPT_ENGINE_CACHE=/path")


def test_resolve_reads_the_process_environment_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv(guard.ENV_RECOMPILE, "1")
    monkeypatch.delenv(guard.ENV_CACHE, raising=False)
    with pytest.raises(GuardError, match="MOPT_RECOMPILE_ON_MISMATCH=1 also needs MOPT_ENGINE_CACHE=/path$"):
        guard.resolve(make_engine(tmp_path), facts=A100)


@pytest.mark.parametrize("given", [True, False])
def test_resolve_opt_in_recompiles_into_the_cache(tmp_path, monkeypatch, given):
    calls = []

    def recompile(out_dir, cache, facts, err):
        calls.append((out_dir, cache, facts, err))
        return cache / "k", {"recompiled": True}

    monkeypatch.setattr(guard, "_recompile", recompile)
    monkeypatch.setattr(guard, "host_facts", lambda: A100)
    out = make_engine(tmp_path)
    env = {guard.ENV_RECOMPILE: "1", guard.ENV_CACHE: str(tmp_path / "cache")}
    result = guard.resolve(str(out), env=env, facts=A100 if given else None)
    assert result == (tmp_path / "cache" / "k", {"recompiled": True})
    [(out_dir, cache, facts, err)] = calls
    assert (out_dir, cache, facts) == (out, tmp_path / "cache", A100)
    assert isinstance(out_dir, Path) and isinstance(cache, Path)
    assert isinstance(err, guard.EngineMismatch) and err.message.startswith("engine built for sm_86")


# --- integrity hashed ahead (the model cache overlaps it with importing torch) --------------------

def test_integrity_ahead_is_used_and_not_hashed_again(tmp_path, monkeypatch):
    out = make_engine(tmp_path)
    ahead = guard.integrity_ahead(out)
    assert ahead is not None and ahead.problem is None
    hashed = []
    monkeypatch.setattr(guard.fingerprint, "sha256_file", lambda path: hashed.append(path) or "0" * 64)
    assert guard.check(out, A10G, ahead)["target_sm"] == "86"
    assert hashed == [] and "integrity" not in guard.LAST_CHECK_SECONDS


def test_integrity_ahead_of_a_tampered_engine_refuses_it(tmp_path):
    out = make_engine(tmp_path)
    (out / "engine" / "model.pt2").write_bytes(b"not a real engine!")
    ahead = guard.integrity_ahead(out)
    assert ahead.problem == (f"engine in {out / 'engine'} failed its integrity check: model.pt2 sha256 differs "
                             "from engine.json; rebuild or re-pull the image")
    with pytest.raises(GuardError, match="model.pt2 sha256 differs from engine.json"):
        guard.check(out, A10G, ahead)


def test_a_file_changed_after_hashing_ahead_is_hashed_again(tmp_path):
    out = make_engine(tmp_path)
    ahead = guard.integrity_ahead(out)
    artifact = out / "engine" / "model.pt2"
    st = artifact.stat()
    artifact.write_bytes(b"not a real engin!")  # same size; mtime set back below, the ctime moves anyway
    os.utime(artifact, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(GuardError, match="model.pt2 sha256 differs from engine.json"):
        guard.check(out, A10G, ahead)
    assert "integrity" in guard.LAST_CHECK_SECONDS  # hashed again


def test_an_engine_json_changed_after_hashing_ahead_is_hashed_again(tmp_path):
    out = make_engine(tmp_path)
    ahead = guard.integrity_ahead(out)
    (out / "engine" / "model.pt2").write_bytes(b"another engine")
    edit(out, engine_files=fingerprint.file_hashes(out / "engine"))  # consistent files, new engine.json
    with pytest.raises(GuardError, match="engine_sha256 in engine.json does not match"):
        guard.check(out, A10G, ahead)  # the ahead result (all matched) was for the old engine.json
    assert "integrity" in guard.LAST_CHECK_SECONDS  # hashed again


def test_another_dirs_ahead_result_is_not_taken(tmp_path):
    good, bad = make_engine(tmp_path / "a"), make_engine(tmp_path / "b")
    (bad / "engine" / "model.pt2").write_bytes(b"not a real engine!")
    with pytest.raises(GuardError, match="model.pt2 sha256 differs"):
        guard.check(bad, A10G, guard.integrity_ahead(good))


@pytest.mark.parametrize("damage", ["no engine.json", "not json", "not an object", "files not a dict"])
def test_integrity_ahead_of_an_unreadable_entry_is_none(tmp_path, damage):
    out = make_engine(tmp_path)
    meta = out / "engine.json"
    if damage == "no engine.json":
        meta.unlink()
    elif damage == "not json":
        meta.write_text("{")
    elif damage == "not an object":
        meta.write_text("[1]")
    else:
        edit(out, engine_files=["model.pt2"])
    assert guard.integrity_ahead(out) is None


def test_a_recompile_keeps_a_precision_only_where_backend_and_gpu_take_it():
    """The opt-in recompile (resolve): bf16 stays on a GPU, int8 on a CPU, fp8 from sm_89; fp8 on an older GPU
    becomes bf16 (its _scaled_mm refuses the arch), a precision the backend lacks on the device fp32."""
    from builder.runtime.guard import recompile_precision

    assert recompile_precision("torch-aot", "fp8", "cuda", "90") == "fp8"
    assert recompile_precision("torch-aot", "fp8", "cuda", "89") == "fp8"
    assert recompile_precision("torch-aot", "fp8", "cuda", "86") == "bf16"
    assert recompile_precision("torch-aot", "fp8", "cpu", None) == "fp32"
    assert recompile_precision("torch-aot", "bf16", "cuda", "80") == "bf16"
    assert recompile_precision("torch-aot", "bf16", "cpu", None) == "fp32"
    assert recompile_precision("torch-aot", "int8", "cpu", None) == "int8"
    assert recompile_precision("torch-aot", "int8", "cuda", "90") == "fp32"


def test_the_runtimes_precision_archs_are_the_knowledge_bases():
    """params.PRECISION_MIN_SM (what the runtime's guard reads) says what compat.yaml's sourced rows say."""
    from builder.compat import knowledge_base
    from builder.runtime.params import PRECISION_MIN_SM

    rows = knowledge_base().data["precisions"]
    assert {row["precision"]: int(row["min_sm"]) for row in rows} == PRECISION_MIN_SM
