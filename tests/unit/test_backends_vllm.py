"""vLLM backend: engine arguments shared by the compile warm-up and `vllm serve`, the serve command,
its environment and the cache digest (no vLLM needed); the in-process
compile runs only where vllm is importable (the vllm-cpu image: tests/integration/test_vllm_cpu.py)."""
from __future__ import annotations

import pytest

from builder.runtime.backends import get_backend
from builder.runtime.backends import vllm_backend as vb
from builder.runtime.errors import UsageError
from builder.runtime.params import EngineParams


def params(**kw):
    base = dict(backend="vllm", device="cpu", precision="fp32", max_batch=32, max_seq_len=256, pooling="mean",
                model_dir="/opt/mopt/model", model_name="mopt/minilm-embed")
    return EngineParams(**{**base, **kw})


def test_registered():
    assert get_backend("vllm") is vb


def test_engine_args_match_the_recipe():
    args = vb.engine_args(params())
    assert args == {"runner": "pooling", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 32,
                    "max_num_batched_tokens": 8192, "seed": 0, "distributed_executor_backend": "uni"}
    cuda = vb.engine_args(params(device="cuda", precision="bf16"))
    assert cuda["dtype"] == "bfloat16" and "distributed_executor_backend" not in cuda


def test_vllm_takes_no_tensorrt_precision():
    with pytest.raises(UsageError):
        params(device="cuda", precision="int8")


def test_serve_argv_uses_the_compile_engine_args():
    argv = vb.serve_argv("/opt/mopt/model", params(), "0.0.0.0", 8000, python="/opt/venv/bin/python")
    assert argv[:5] == ["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                        "/opt/mopt/model"]
    joined = " ".join(argv)
    for key, value in vb.engine_args(params()).items():
        assert f"--{key.replace('_', '-')} {value}" in joined
    assert "--served-model-name mopt/minilm-embed" in joined
    assert argv[argv.index("--port") + 1] == "8000" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[-1] == "--disable-uvicorn-access-log"  # mopt's server logs the requests


def test_serve_env_points_at_the_shipped_cache(tmp_path):
    env = vb.serve_env(tmp_path / "engine" / "vllm-cache", params(), {"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "engine" / "vllm-cache")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # a user's setting wins
    assert env["VLLM_MQ_MAX_CHUNK_BYTES_MB"] == vb.MQ_CHUNK_MIB
    assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"  # no g++ at every start
    assert "VLLM_CPU_KVCACHE_SPACE" not in vb.serve_env(tmp_path, params(device="cuda", precision="bf16"), {})


def test_cache_digest(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"1")
    first = vb.cache_digest(tmp_path)
    assert first[1] == 1
    (tmp_path / "a" / "b" / "x.bin").write_bytes(b"2")
    assert vb.cache_digest(tmp_path)[0] != first[0]


def test_guard_runs_before_vllm_serve(tmp_path, monkeypatch):
    """`python -m mopt_runtime serve` on a tampered vllm engine exits 3 and never starts vLLM."""
    from builder.runtime import __main__ as cli
    from builder.runtime import fingerprint

    out = tmp_path / "out"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / vb.ARTIFACT).write_text("{}")
    files = fingerprint.file_hashes(out / "engine")
    fingerprint.write(out, {"backend": "vllm", "backend_version": vb.version(), "torch": "x", "cuda": None,
                            "tensorrt": None, "device": "cpu", "target_sm": None, "gpu_name": None, "driver": None,
                            "engine_files": files, "engine_sha256": "0" * 64, "artifact": vb.ARTIFACT,
                            "model_digest": "", "params": params().to_dict(), "image": None,
                            "compile_seconds": 0})
    monkeypatch.setattr(vb, "load", lambda *a: pytest.fail("vLLM's server must not start"))
    assert cli.main(["serve", "--no-engine-process", "--engine-dir", str(out)]) == 3


def test_vllm_is_served_by_mopts_server():
    """One API on every flavour: vllm is not exec'd, its server runs behind mopt's."""
    from builder.runtime.backends import backend_info

    assert backend_info("vllm").own_server is False
    with pytest.raises(UsageError, match="served by mopt's server"):
        vb.exec_serve("/x", {}, "0.0.0.0", 8000)


def test_compile_with_vllm(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment; the vllm-cpu image runs "
                                       "this path (tests/integration/test_vllm_cpu.py)")
    from builder.runtime.compiler import compile_engine
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "model", 0)
    result = compile_engine(model, tmp_path / "out", params(pooling="last", model_dir=str(model)),
                            reference_texts=["hello"])
    assert result["engine_min_cosine"] > 0.99
