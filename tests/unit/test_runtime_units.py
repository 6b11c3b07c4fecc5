"""Fast unit tests of the in-image runtime: guard decisions on a fake engine dir and fake host
facts (no compile), fitting-tag advice, params validation, input parsing, metrics, buckets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("tokenizers", reason="the runtime needs tokenizers")

from builder.runtime import fingerprint, guard  # noqa: E402
from builder.runtime.engine import bucket_len  # noqa: E402
from builder.runtime.errors import GuardError, UsageError  # noqa: E402
from builder.runtime.hostinfo import HostFacts, host_facts  # noqa: E402
from builder.runtime.metrics import Metrics  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.service import ApiError, parse_inputs  # noqa: E402

pytestmark = pytest.mark.runtime

IMAGE = {"repository": "mopt/qwen3-embed", "tag": "cu128-sm90", "tag_template": "cu{cuda}-sm{sm}",
         "tags_by_sm": {"86": "cu128-sm86", "90": "cu128-sm90"}}
H200 = HostFacts(torch="2.11.0+cu128", cuda="12.8", tensorrt=None, sm="90", gpu_name="NVIDIA H200",
                 driver="580.1")
A10G = HostFacts(torch="2.11.0+cu128", cuda="12.8", tensorrt=None, sm="86", gpu_name="NVIDIA A10G",
                 driver="580.1")
NO_GPU = HostFacts(torch="2.11.0+cu128", cuda="12.8", tensorrt=None, sm=None, gpu_name=None, driver=None)
L4 = HostFacts(torch="2.11.0+cu128", cuda="12.8", tensorrt=None, sm="89", gpu_name="NVIDIA L4",
               driver="580.1")


def fake_engine(tmp_path: Path, facts: HostFacts = H200, image=IMAGE) -> Path:
    """An engine dir as a CUDA compile on `facts` would write it, with a dummy artifact."""
    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "model.pt2").write_bytes(b"not a real engine")
    (out / "engine" / "tokenizer.json").write_text("{}")
    files = fingerprint.file_hashes(out / "engine")
    fingerprint.write(out, {
        "backend": "torch-aot", "backend_version": facts.torch, "torch": facts.torch, "cuda": facts.cuda,
        "tensorrt": None, "device": "cuda", "target_sm": facts.sm, "gpu_name": facts.gpu_name,
        "driver": facts.driver, "engine_files": files, "engine_sha256": files["model.pt2"],
        "artifact": "model.pt2", "model_digest": "0" * 64, "compile_seconds": 1.0, "image": image,
        "params": EngineParams(device="cuda", precision="bf16").to_dict()})
    return out


def edit(out: Path, **changes) -> None:
    data = json.loads((out / "engine.json").read_text())
    data.update(changes)
    (out / "engine.json").write_text(json.dumps(data))


def test_guard_passes_on_matching_host(tmp_path):
    assert guard.check(fake_engine(tmp_path), H200)["target_sm"] == "90"


def test_guard_names_fitting_tag_for_other_sm(tmp_path):
    with pytest.raises(GuardError) as exc:
        guard.check(fake_engine(tmp_path), A10G)
    assert exc.value.exit_code == 3
    assert str(exc.value) == ("engine built for sm_90 (NVIDIA H200) but this host's GPU is sm_86 "
                              "(NVIDIA A10G): pull mopt/qwen3-embed:cu128-sm86")


def test_guard_says_plainly_when_no_tag_fits(tmp_path):
    with pytest.raises(GuardError, match=r"no published tag of mopt/qwen3-embed fits sm_89 "
                                         r"\(published: sm_86, sm_90\)"):
        guard.check(fake_engine(tmp_path), L4)


def test_guard_refuses_without_gpu(tmp_path):
    with pytest.raises(GuardError, match="this host has no usable CUDA GPU: no published tag"):
        guard.check(fake_engine(tmp_path), NO_GPU)


def test_guard_refuses_other_cuda_and_torch(tmp_path):
    other = HostFacts(**{**H200.to_dict(), "cuda": "13.0", "torch": "2.12.0+cu130"})
    with pytest.raises(GuardError) as exc:
        guard.check(fake_engine(tmp_path), other)
    msg = str(exc.value)
    assert "torch 2.11.0+cu128 but this host runs torch 2.12.0+cu130" in msg
    assert "CUDA 12.8 but this host's torch has CUDA 13.0" in msg
    assert msg.endswith("pull mopt/qwen3-embed:cu128-sm90")


def test_guard_refuses_tampered_file_and_sha(tmp_path):
    out = fake_engine(tmp_path)
    (out / "engine" / "tokenizer.json").write_text('{"x": 1}')
    with pytest.raises(GuardError, match="tokenizer.json sha256 differs from engine.json"):
        guard.check(out, H200)
    out2 = fake_engine(tmp_path / "b")
    edit(out2, engine_sha256="f" * 64)
    with pytest.raises(GuardError, match="engine_sha256 in engine.json does not match"):
        guard.check(out2, H200)


def test_integrity_failure_is_never_recompiled(tmp_path):
    out = fake_engine(tmp_path)
    (out / "engine" / "model.pt2").write_bytes(b"corrupt")
    env = {guard.ENV_RECOMPILE: "1", guard.ENV_CACHE: str(tmp_path / "cache")}
    with pytest.raises(GuardError, match="integrity"):
        guard.resolve(out, env=env, facts=H200)
    assert not (tmp_path / "cache").exists()


def test_recompile_needs_cache_and_model(tmp_path):
    out = fake_engine(tmp_path)
    with pytest.raises(GuardError, match="also needs MOPT_ENGINE_CACHE"):
        guard.resolve(out, env={guard.ENV_RECOMPILE: "1"}, facts=A10G)
    with pytest.raises(GuardError, match="cannot recompile: model dir None is not present"):
        guard.resolve(out, env={guard.ENV_RECOMPILE: "1", guard.ENV_CACHE: str(tmp_path / "c")}, facts=A10G)


def test_fitting_tag_variants():
    assert guard.fitting_tag({"repository": "r", "tags_by_sm": {"cpu": "cpu"}}, NO_GPU) == "pull r:cpu"
    tmpl = guard.fitting_tag({"repository": "r", "tag_template": "cu{cuda}-sm{sm}"}, A10G)
    assert tmpl.endswith("would be r:cu128-sm86 if it exists")
    assert "no image info" in guard.fitting_tag(None, A10G)


def test_engine_json_missing_or_wrong_schema(tmp_path):
    with pytest.raises(GuardError, match="not an engine directory"):
        fingerprint.read(tmp_path)
    out = fake_engine(tmp_path)
    edit(out, schema_version=99)
    with pytest.raises(GuardError, match="schema_version 99"):
        fingerprint.read(out)


def test_model_digest_sees_content_and_names(tmp_path):
    (tmp_path / "a").write_text("1")
    d1 = fingerprint.model_digest(tmp_path)
    (tmp_path / "a").write_text("2")
    d2 = fingerprint.model_digest(tmp_path)
    (tmp_path / "a").rename(tmp_path / "b")
    assert len({d1, d2, fingerprint.model_digest(tmp_path)}) == 3


def test_host_facts_on_this_host():
    import torch

    facts = host_facts()
    assert facts.torch == torch.__version__ and facts.cuda == torch.version.cuda
    if not torch.cuda.is_available():
        assert facts.sm is None and facts.gpu_name is None


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "cpu", "precision": "bf16"}, r"--precision bf16 is not one torch-aot takes on cpu \(fp32, int8\)"),
    ({"device": "cuda", "precision": "int8"},
     r"--precision int8 is not one torch-aot takes on cuda \(fp32, bf16, fp16, fp8\)"),
    ({"backend": "vllm", "device": "cpu", "precision": "int8"}, r"not one vllm takes on cpu \(fp32\)"),
    ({"pooling": "max"}, "--pooling"),
    ({"max_batch": 0}, "--max-batch"),
    ({"max_seq_len": 4}, "--max-seq-len"),
])
def test_params_validation(kwargs, match):
    with pytest.raises(UsageError, match=match):
        EngineParams(**kwargs)


def test_params_round_trip():
    p = EngineParams(device="cuda", precision="fp16", pooling="last", instruction="x")
    assert EngineParams.from_dict({**p.to_dict(), "unknown_future_field": 1}) == p


def test_bucket_len():
    assert [bucket_len(n, 64) for n in (1, 8, 9, 63, 64)] == [8, 8, 16, 64, 64]
    assert bucket_len(61, 62) == 62


@pytest.mark.parametrize("body, code", [
    ([], "invalid_body"), ({}, "missing_input"), ({"input": ""}, "empty_input"),
    ({"input": []}, "invalid_input"), ({"input": 5}, "invalid_input"), ({"input": ["a", 1]}, "invalid_input"),
    ({"input": [[1], "a"]}, "invalid_input"), ({"input": [[]]}, "invalid_input"),
    ({"input": ["a"] * 5}, "too_many_inputs"),
])
def test_parse_inputs_rejects(body, code):
    with pytest.raises(ApiError) as exc:
        parse_inputs(body, max_inputs=4)
    assert exc.value.status == 400 and exc.value.code == code
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_parse_inputs_accepts():
    assert parse_inputs({"input": "a"}, 4) == (["a"], False)
    assert parse_inputs({"input": [1, 2]}, 4) == ([[1, 2]], True)
    assert parse_inputs({"input": [[1], [2, 3]]}, 4) == ([[1], [2, 3]], True)


def test_metrics_render():
    m = Metrics()
    m.request_done(200, 0.02, tokens=7, inputs=2)
    m.request_done(400, 0.001)
    m.batch_done(3)
    m.set_queue_depth(2)
    text = m.render().decode()
    route = 'route="/v1/embeddings"'
    for line in (f'mopt_requests_total{{{route},status="200"}} 1.0',
                 f'mopt_requests_total{{{route},status="400"}} 1.0',
                 "mopt_tokens_total 7.0", "mopt_queue_depth 2.0",
                 f'mopt_request_latency_seconds_bucket{{le="0.025",{route}}} 2.0',
                 f"mopt_request_latency_seconds_count{{{route}}} 2.0", 'mopt_batch_size_bucket{le="2.0"} 0.0',
                 'mopt_batch_size_bucket{le="4.0"} 1.0'):
        assert line in text.splitlines(), line


@pytest.mark.parametrize("line, version", [
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (builder@U16)",
     "580.159.04"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024", "535.183.01"),
])
def test_driver_version_from_the_kernel_module_file(tmp_path, monkeypatch, line, version):
    from builder.runtime import hostinfo

    path = tmp_path / "version"
    path.write_text(line + "\nGCC version:  gcc version 12.2.0\n")
    monkeypatch.setattr(hostinfo, "PROC_DRIVER_VERSION", path)
    assert hostinfo._driver_version() == version


def test_server_writes_the_same_json_with_or_without_orjson(monkeypatch):
    pytest.importorskip("orjson", reason="orjson is a runtime dependency (pyproject's runtime extra)")
    from builder.runtime import server

    body = {"object": "list", "data": [{"embedding": [0.1, -2.5e-07, 1.0, 3.0000000000000004]}], "n": None}
    fast = server.dumps(body)
    monkeypatch.setattr(server, "orjson", None)
    assert json.loads(fast) == json.loads(server.dumps(body)) == body
