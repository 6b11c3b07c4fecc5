"""TensorRT-LLM: an engine built with trtllm-build (TensorRT backend) inside the runtime image, served
by `trtllm-serve` (OpenAI-compatible /v1/chat/completions, /v1/completions, /health).

engine/trtllm-engine/    rank0.engine + config.json from trtllm-build (the artifact: rank0.engine)
engine/trtllm-build.json the checkpoint conversion and build commands, TensorRT-LLM version

tensorrt_llm is imported lazily (inside functions) and its CLIs are run as subprocesses: the guard,
the build side and the unit tests import this module on hosts without it (it cannot be installed on
the build machines: its wheels come from NVIDIA's index).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..params import EngineParams

ENGINE_SUBDIR = "trtllm-engine"
ARTIFACT = f"{ENGINE_SUBDIR}/rank0.engine"
BUILD_INFO = "trtllm-build.json"
# TensorRT-LLM checkpoint dtypes per mopt precision (int8/fp8 need a quantised checkpoint: not here).
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tensorrt_llm")
    except metadata.PackageNotFoundError:
        return "not-installed"


def _dtype(params: EngineParams) -> str:
    try:
        return DTYPES[params.precision]
    except KeyError:
        raise ValueError(f"tensorrt-llm takes precision {', '.join(DTYPES)}, not {params.precision!r}") from None


def convert_command(model_dir: str, ckpt_dir: str, params: EngineParams, python: str | None = None) -> list[str]:
    """HF checkpoint -> TensorRT-LLM checkpoint (the model family's convert_checkpoint, via the LLM API)."""
    return [python or sys.executable, "-m", "mopt_runtime.backends.tensorrt_llm", "convert",
            "--model", model_dir, "--out", ckpt_dir, "--dtype", _dtype(params)]


def build_command(ckpt_dir: str, engine_dir: str, params: EngineParams, exe: str = "trtllm-build") -> list[str]:
    return [exe, "--checkpoint_dir", ckpt_dir, "--output_dir", engine_dir,
            "--max_batch_size", str(params.max_batch), "--max_input_len", str(params.max_seq_len),
            "--max_seq_len", str(params.max_seq_len * 2),
            "--max_num_tokens", str(params.max_batch * params.max_seq_len),
            "--gemm_plugin", "auto", "--remove_input_padding", "enable", "--paged_kv_cache", "enable",
            "--workers", "1"]


def serve_command(engine_dir: str, tokenizer_dir: str, params: EngineParams, host: str, port: int,
                  exe: str = "trtllm-serve") -> list[str]:
    """trtllm-serve over the shipped engine (backend tensorrt: no rebuild at start-up)."""
    return [exe, "serve", engine_dir, "--tokenizer", tokenizer_dir, "--backend", "tensorrt",
            "--host", host, "--port", str(port), "--max_batch_size", str(params.max_batch),
            "--max_seq_len", str(params.max_seq_len * 2)]


def convert(model_dir: str, out: str, dtype: str) -> None:
    """Run inside the runtime: the LLM API's model family converts the HF weights."""
    from tensorrt_llm.models import AutoModelForCausalLM  # lazily: only the runtime image has it

    model = AutoModelForCausalLM.from_hugging_face(model_dir, dtype=dtype)
    model.save_checkpoint(out, save_config=True)


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({proc.returncode}): {proc.stderr[-800:]}")


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    out_dir = Path(out_dir)
    exe = shutil.which("trtllm-build")
    if not exe:
        raise RuntimeError("trtllm-build is not on PATH: this is not a TensorRT-LLM runtime image")
    with tempfile.TemporaryDirectory(prefix="mopt-trtllm-") as tmp:
        convert_argv = convert_command(model_dir, tmp, params)
        _run(convert_argv)
        build_argv = build_command(tmp, str(out_dir / ENGINE_SUBDIR), params, exe)
        _run(build_argv)
    info = {"tensorrt_llm": version(), "convert": convert_argv[1:], "build": build_argv[1:]}
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    config = json.loads((out_dir / ENGINE_SUBDIR / "config.json").read_text())
    hidden = config.get("pretrained_config", {}).get("hidden_size", 0)
    return {"artifact": ARTIFACT, "embedding_dim": int(hidden), "export_dims": "trtllm",
            "fingerprint": {"tensorrt_llm": {"version": info["tensorrt_llm"]}}}


def load(engine_dir: str | Path, params: EngineParams):
    raise NotImplementedError("tensorrt-llm engines are served by trtllm-serve (python -m mopt_runtime serve "
                              "execs it), not loaded in-process")


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    return []  # a chat image has no embedding reference; its smoke test talks to trtllm-serve


def prepare(device: str) -> None:
    """Nothing to warm: trtllm-serve loads the engine."""


def check_http_options(options) -> None:
    """trtllm-serve has no API key or CORS option: refuse a key (serving open while the user believes
    it guarded would be worse than not starting) and say that CORS is not applied."""
    if options is None:
        return
    if options.api_key:
        raise UsageError("tensorrt-llm images serve through trtllm-serve, which has no API key option: "
                         "unset --api-key/MOPT_API_KEY and put an authenticating proxy in front")
    if options.cors_origins:
        print("mopt_runtime: trtllm-serve has no CORS option; --cors-origins is not applied",
              file=sys.stderr, flush=True)


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
    check_http_options(options)
    params = EngineParams.from_dict(data["params"])
    engine_dir = Path(out_dir) / "engine"
    argv = serve_command(str(engine_dir / ENGINE_SUBDIR), str(engine_dir), params, host, port,
                         shutil.which("trtllm-serve") or "trtllm-serve")
    print(f"mopt_runtime: guard passed; exec {' '.join(argv)}", file=sys.stderr, flush=True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":  # `python -m mopt_runtime.backends.tensorrt_llm convert ...` (see convert_command)
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("command", choices=("convert",))
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", required=True)
    a = p.parse_args()
    convert(a.model, a.out, a.dtype)
