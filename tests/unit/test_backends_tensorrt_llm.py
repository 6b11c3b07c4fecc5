"""TensorRT-LLM backend: command construction for the checkpoint conversion, trtllm-build and
trtllm-serve (no TensorRT-LLM needed); the real build runs only where tensorrt_llm is importable."""
from __future__ import annotations

import pytest

from builder.runtime.backends import get_backend
from builder.runtime.backends import tensorrt_llm as tl
from builder.runtime.params import EngineParams


def params(**kw):
    base = dict(backend="tensorrt-llm", device="cuda", precision="bf16", max_batch=16, max_seq_len=2048,
                pooling="last", normalize=False)
    return EngineParams(**{**base, **kw})


def test_registered():
    assert get_backend("tensorrt-llm") is tl


def test_convert_command():
    argv = tl.convert_command("/opt/mopt/model", "/tmp/ckpt", params(), python="/opt/venv/bin/python")
    assert argv == ["/opt/venv/bin/python", "-m", "mopt_runtime.backends.tensorrt_llm", "convert",
                    "--model", "/opt/mopt/model", "--out", "/tmp/ckpt", "--dtype", "bfloat16"]


def test_build_command_carries_the_recipe_bounds():
    argv = tl.build_command("/tmp/ckpt", "/mopt/out/engine/trtllm-engine", params())
    opts = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "trtllm-build"
    assert opts["--checkpoint_dir"] == "/tmp/ckpt" and opts["--output_dir"] == "/mopt/out/engine/trtllm-engine"
    assert opts["--max_batch_size"] == "16" and opts["--max_input_len"] == "2048"
    assert opts["--max_num_tokens"] == str(16 * 2048)


def test_serve_command_is_trtllm_serve_openai():
    argv = tl.serve_command("/opt/mopt/engine/engine/trtllm-engine", "/opt/mopt/engine/engine", params(),
                            "0.0.0.0", 8000)
    assert argv[:3] == ["trtllm-serve", "serve", "/opt/mopt/engine/engine/trtllm-engine"]
    assert argv[argv.index("--backend") + 1] == "tensorrt"  # the shipped engine, not a PyTorch-flow rebuild
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--tokenizer") + 1] == "/opt/mopt/engine/engine"


def test_quantised_precisions_are_refused():
    with pytest.raises(ValueError, match="tensorrt-llm takes precision"):
        tl._dtype(params(backend="tensorrt", precision="fp8"))


def test_version_without_tensorrt_llm():
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        assert tl.version() == "not-installed"


def test_load_points_at_trtllm_serve():
    with pytest.raises(NotImplementedError, match="trtllm-serve"):
        tl.load("/nowhere", params())


def test_build_engine_with_tensorrt_llm(tmp_path):
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not importable here: its wheels come from "
                                               "NVIDIA's index, which is unreachable from the build machines")
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "model", 0)
    info = tl.compile(str(model), params(max_batch=2, max_seq_len=64), tmp_path / "out")
    assert (tmp_path / "out" / info["artifact"]).is_file()
