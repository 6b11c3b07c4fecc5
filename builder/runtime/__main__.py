"""CLI: compile | check | serve | warm | make-tiny-qwen3. Exit codes: 0 ok, 2 bad input, 3 engine does
not fit this host (guard), 4 compile failed; user errors print one line, never a traceback."""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

from .cudacompat import reexec_if_needed
from .errors import GuardError, RuntimeToolError, UsageError

# (subcommand, flag) -> the environment variable that gives the flag's default (docs/cli.md lists them).
ENV_VARS: dict[tuple[str, str], str] = {}


def _typed(cast, env: str):
    """CAST for argparse, whose error also names the variable (the value may have come from it)."""
    def convert(text: str):
        try:
            return cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {cast.__name__} (given as the option "
                                             f"or by {env})") from None

    convert.__name__ = cast.__name__
    return convert


def _env_argument(parser: argparse.ArgumentParser, command: str, flag: str, env: str, *, default, **kwargs):
    """An option whose default comes from ENV when set. argparse converts a string default with the
    option's type, so a bad value is the same one-line usage error (exit 2) as a bad flag."""
    ENV_VARS[(command, flag)] = env
    value = os.environ.get(env)
    kwargs["help"] = f"{kwargs.get('help', '')} [env: {env}]".strip()
    if kwargs.get("action") is argparse.BooleanOptionalAction and value not in (None, ""):
        value = _env_bool(env, value)
    if "type" in kwargs:
        kwargs["type"] = _typed(kwargs["type"], env)
    return parser.add_argument(flag, default=value if value not in (None, "") else default, **kwargs)


def _model_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names) or any(len(n) > 256 or not n.isprintable() for n in names) or len(set(names)) < len(names):
        raise ValueError(text)
    return names


def _env_bool(env: str, text: str) -> bool:
    """A boolean option's value from the environment; anything but true/false/1/0/yes/no/on/off is
    the one-line usage error (exit 2) of a bad flag."""
    value = {"1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False}.get(text.strip().lower())
    if value is None:
        print(f"error: {env}={text!r} is not a boolean (true/false/1/0)", file=sys.stderr)
        sys.exit(2)
    return value


def _load_json_arg(flag: str, text: str | None, expect: type):
    if text is None:
        return None
    try:
        # A file path or, for objects, inline JSON text.
        inline = expect is dict and text.lstrip().startswith("{")
        value = json.loads(text if inline else Path(text).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{flag}: {exc}") from None
    if not isinstance(value, expect) or (expect is list and not all(isinstance(x, str) for x in value)):
        raise UsageError(f"{flag}: expected a JSON {'list of strings' if expect is list else 'object'}")
    return value


def _engine_dir_argument(parser: argparse.ArgumentParser, command: str) -> None:
    """--engine-dir, by default MOPT_ENGINE_DIR (the images set it): `docker run IMAGE` needs no flag."""
    _env_argument(parser, command, "--engine-dir", "MOPT_ENGINE_DIR", default=None,
                  required=not os.environ.get("MOPT_ENGINE_DIR"),
                  help="engine dir (engine.json + engine/); required unless the variable is set")


def _engine_flags(c: argparse.ArgumentParser, serving: bool = False) -> None:
    """The engine parameters as flags, for a compile by hand (mopt's build passes --params) or a mounted
    model's compile (serve/warm --model-id). A flag not given takes params.EngineParams' default: the
    contract is the one place defaults live. SERVING: serve's own --max-batch and --max-batch-tokens
    (the batcher's) are these parameters too, and the served name is --served-model-name."""
    from . import params as contract

    e = c.add_argument_group("engine parameters", "each defaults to builder/runtime/params.py's EngineParams")
    flag = {"default": argparse.SUPPRESS}
    e.add_argument("--backend", **flag)
    e.add_argument("--device", choices=contract.DEVICES, **flag)
    e.add_argument("--precision", choices=contract.PRECISIONS,
                   help="one the backend takes on the device: backends/<name>.yaml's precisions "
                   "(int8: torch-aot on cpu, tensorrt; fp8: torch-aot and tensorrt on cuda, sm_89 and newer)", **flag)
    if not serving:
        e.add_argument("--max-batch", type=int, **flag)
    e.add_argument("--max-seq-len", type=int, **flag)
    e.add_argument("--pooling", choices=contract.POOLINGS, **flag)
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, **flag)
    e.add_argument("--instruction", help="task for queries: 'Instruct: {task}\\nQuery:{q}'", **flag)
    e.add_argument("--compile-mode", choices=contract.COMPILE_MODES,
                   help="Inductor mode (--backend torch-aot or torch-inductor): autotuning runs once, here", **flag)
    e.add_argument("--attention", choices=contract.ATTENTIONS,
                   help="causal: causal decoders only; right padding and SDPA's is_causal, no mask tensor "
                        "(flash attention). Exact: a real token never attends to a padded one", **flag)
    e.add_argument("--input", dest="input_form", choices=contract.INPUT_FORMS,
                   help="packed (torch-aot, torch-inductor): every sequence of a call in one token stream, no "
                        "padding; variable-length flash attention on CUDA (fp16/bf16), per-sequence SDPA elsewhere",
                   **flag)
    if not serving:
        e.add_argument("--max-batch-tokens", type=int,
                       help="packed: the most tokens one engine call takes (0: max-batch x max-seq-len)", **flag)
        e.add_argument("--model-name", help="name served in responses (default: the image's repository, else the "
                       "model dir's name)", **flag)
    e.add_argument("--matryoshka-min-dim", type=int,
                   help="the model serves Matryoshka dimensions from this one up to the full one "
                        "(Qwen3-Embedding: 32); requests' 'dimensions' truncate and re-normalise", **flag)
    t = c.add_argument_group("tensorrt", "optimisation profile and builder options (--backend tensorrt)")
    t.add_argument("--trt-min-batch", type=int, **flag)
    t.add_argument("--trt-opt-batch", type=int, help="0: --max-batch", **flag)
    t.add_argument("--trt-min-seq-len", type=int, **flag)
    t.add_argument("--trt-opt-seq-len", type=int, help="0: --max-seq-len", **flag)
    t.add_argument("--trt-opset", type=int, help="ONNX opset (>= 17)", **flag)
    t.add_argument("--trt-hardware-compatibility", choices=contract.HARDWARE_COMPATIBILITY, **flag)
    t.add_argument("--trt-version-compatible", action=argparse.BooleanOptionalAction, **flag)
    t.add_argument("--trt-timing-cache", action=argparse.BooleanOptionalAction, **flag)
    t.add_argument("--trt-workspace-mib", type=int, **flag)


def _model_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """A mounted model compiled into a cache on first use (modelcache.py): serve and warm."""
    from .compiler import DEFAULT_MIN_COSINE

    m = parser.add_argument_group("a mounted model", "instead of a baked engine dir: the engine is compiled "
                                  "into --cache-dir on first use (docs/run-image.md)")
    _env_argument(m, command, "--model-id", "MOPT_MODEL_ID", default=None,
                  help="a Hugging Face model directory (config.json, tokenizer.json, weights), mounted read-only")
    _env_argument(m, command, "--cache-dir", "MOPT_CACHE_DIR", default=None,
                  help="where compiled engines are kept, keyed by model, parameters, runtime and GPU (a volume)")
    _env_argument(m, command, "--engine-params", "MOPT_ENGINE_PARAMS", default=None,
                  help="engine parameters as a JSON object or a params.json file (a runtime image sets its "
                       "flavour's); the engine flags below override single fields")
    _env_argument(m, command, "--min-cosine", "MOPT_MIN_COSINE", type=float, default=DEFAULT_MIN_COSINE,
                  help="the accuracy gate: an engine whose cosine vs the model's fp32 reference is lower is "
                       "refused (exit 4)")
    m.add_argument("--force-pooling", action="store_true",
                   help="the given --pooling/--normalize even where they contradict the model's "
                        "sentence-transformers files")
    _engine_flags(parser, serving=command == "serve")


def _model_source(a):
    """--model-id and the engine parameters (the image's JSON, then single flags) as a ModelSource."""
    from dataclasses import fields

    from .modelcache import model_source
    from .params import EngineParams

    base = _load_json_arg("--engine-params", a.engine_params, dict) or {}
    flags = {f.name: getattr(a, f.name) for f in fields(EngineParams)
             if getattr(a, f.name, None) is not None}  # serve's --max-batch default is None: not given
    merged = {**base, **flags}
    params = EngineParams.parse(merged, "--engine-params and the engine flags")
    return model_source(a.model_id, a.cache_dir, params, set(merged), min_cosine=a.min_cosine,
                        force_pooling=a.force_pooling)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mopt_runtime", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile an engine + engine.json + reference.json")
    c.add_argument("--model", required=True, help="Hugging Face model dir (config.json, tokenizer.json)")
    c.add_argument("--out", required=True, help="output dir: engine/, engine.json, reference.json")
    c.add_argument("--params", default=None, help="the engine parameters as JSON (params.json, what mopt's "
                   "build writes): instead of the engine flags below")
    c.add_argument("--target-sm", default=None, help="expected GPU arch, e.g. 90 (must match the GPU)")
    c.add_argument("--image-info", default=None, help="JSON text or file: repository, tag, tag_template, tags_by_sm")
    c.add_argument("--reference-texts", default=None, help="file with a JSON list of strings")
    c.add_argument("--force-pooling", action="store_true",
                   help="compile with --pooling/--normalize (or the params') even where they contradict the model's "
                        "sentence-transformers files (by default those files decide, and a contradiction is an error)")
    c.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="load the engine after compiling and compare it with the reference")
    c.add_argument("--min-cosine", type=float, default=None,
                   help="refuse (exit 4) an engine whose cosine vs the reference is lower (default 0.99; "
                        "needs --verify)")
    c.add_argument("--cache-key", default=None, help=argparse.SUPPRESS)  # modelcache's key, kept in engine.json
    _engine_flags(c)

    k = sub.add_parser("check", help="run the start-up guard only (exit 3 on mismatch)")
    _engine_dir_argument(k, "check")  # H3

    d = sub.add_parser("doctor", help="what serving here would meet: torch, its CUDA, the GPU and driver or why "
                                      "there is none, the image's CUDA floor, the engine (exit 3 on a problem)")
    _env_argument(d, "doctor", "--engine-dir", "MOPT_ENGINE_DIR", default=None,
                  help="engine dir to check against this host, where the image holds one")

    s = sub.add_parser("serve", help="guard, then serve POST /v1/embeddings, /health, /metrics")
    _env_argument(s, "serve", "--engine-dir", "MOPT_ENGINE_DIR", default=None,
                  help="engine dir (engine.json + engine/); required unless the variable is set or --model-id "
                       "is given (which takes precedence)")
    _env_argument(s, "serve", "--host", "MOPT_HOST", default="0.0.0.0", help="address to listen on")
    _env_argument(s, "serve", "--port", "MOPT_PORT", type=int, default=8000, help="port to listen on")
    _env_argument(s, "serve", "--max-batch", "MOPT_MAX_BATCH", type=int, default=None,
                  help="inputs per engine call (default: the engine's max_batch)")
    _env_argument(s, "serve", "--max-batch-tokens", "MOPT_MAX_BATCH_TOKENS", type=int, default=None,
                  help="tokens per engine call, the batcher's token budget (default: a packed engine's "
                       "max_batch_tokens; none for a padded engine)")
    _env_argument(s, "serve", "--max-wait-ms", "MOPT_MAX_WAIT_MS", type=float, default=5.0,
                  help="how long the batcher waits for more requests to fill a batch")
    _env_argument(s, "serve", "--batch-quiet-ms", "MOPT_BATCH_QUIET_MS", type=float, default=2.0,
                  help="an idle engine's batch goes out once no request came for this long (at most "
                       "--max-wait-ms after the first): a burst of clients lands in one engine call")
    _env_argument(s, "serve", "--engine-depth", "MOPT_ENGINE_DEPTH", type=int, default=2,
                  help="engine calls in flight: 2 sends the next batch just before the running one ends, so the "
                       "engine never waits for the server; 1 waits for each call to end")
    _env_argument(s, "serve", "--engine-process", "MOPT_ENGINE_PROCESS", action=argparse.BooleanOptionalAction,
                  default=True, help="run the engine in a worker process, apart from the HTTP threads (no shared GIL); "
                                         "vLLM's forward passes run in its own process already")
    _env_argument(s, "serve", "--cuda-graphs", "MOPT_CUDA_GRAPHS", action=argparse.BooleanOptionalAction,
                  default=False, help="replay a packed GPU engine's small calls from CUDA graphs captured at start "
                                      "(fewer kernel launches per call; a probe checks them against the engine); "
                                      "experimental, off by default (docs/server.md)")
    _env_argument(s, "serve", "--served-model-name", "MOPT_SERVED_MODEL_NAME", type=_model_names, default=None,
                  help="the model's name in responses and /v1/models, with aliases after commas (as vLLM's "
                       "flag): 'name,alias'; a request naming an alias is answered with it (default: the "
                       "engine's model name)")
    _env_argument(s, "serve", "--max-inputs", "MOPT_MAX_INPUTS", type=int, default=2048,
                  help="inputs per request (OpenAI's limit; langchain-openai sends 1,000 by default)")
    _env_argument(s, "serve", "--max-input-tokens", "MOPT_MAX_INPUT_TOKENS", type=int, default=None,
                  help="tokens per input; default and ceiling: the engine's max_seq_len")
    _env_argument(s, "serve", "--max-body-bytes", "MOPT_MAX_BODY_BYTES", type=int, default=4 << 20,
                  help="request body size")
    _env_argument(s, "serve", "--max-input-chars", "MOPT_MAX_INPUT_CHARS", type=int, default=None,
                  help="characters per input, checked before tokenizing (default: 8 x the token limit)")
    _env_argument(s, "serve", "--max-request-tokens", "MOPT_MAX_REQUEST_TOKENS", type=int, default=131072,
                  help="tokens per request, all inputs together")
    _env_argument(s, "serve", "--max-queue-tokens", "MOPT_MAX_QUEUE_TOKENS", type=int, default=262144,
                  help="tokens waiting for the engine; beyond: 503 with Retry-After")
    _env_argument(s, "serve", "--auto-truncate", "MOPT_AUTO_TRUNCATE", default=False,
                  action=argparse.BooleanOptionalAction,
                  help="truncate over-long inputs when a request does not say (default off: a silent cut "
                       "changes the embedding, so over-long input is a 400)")
    _env_argument(s, "serve", "--api-key", "MOPT_API_KEY", default=None,
                  help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics unless "
                       "--metrics-auth); prefer the variable or --api-key-file: a flag shows in ps")
    _env_argument(s, "serve", "--api-key-file", "MOPT_API_KEY_FILE", default=None,
                  help="file whose content (stripped) is the API key (Docker/Kubernetes secrets)")
    _env_argument(s, "serve", "--metrics-auth", "MOPT_METRICS_AUTH", action=argparse.BooleanOptionalAction,
                  default=False, help="require the API key on /metrics too")
    _env_argument(s, "serve", "--cors-origins", "MOPT_CORS_ORIGINS", default="",
                  help="comma-separated origins allowed by CORS, or '*'; empty: no CORS headers")
    _env_argument(s, "serve", "--max-connections", "MOPT_MAX_CONNECTIONS", type=int, default=2048,
                  help="open connections; beyond, the longest-idle one is closed to make room, and only when every "
                       "one has a request in progress is a new one answered 503")
    _env_argument(s, "serve", "--max-inflight-bytes", "MOPT_MAX_INFLIGHT_BYTES", type=int, default=64 << 20,
                  help="request bodies in flight, all requests together, reserved from Content-Length before a body "
                       "is read; beyond: 503 with Retry-After (docs/server.md: the memory formula)")
    _env_argument(s, "serve", "--tokenizer-threads", "MOPT_TOKENIZER_THREADS", type=int, default=2,
                  help="threads that parse and tokenize requests past --inline-body-bytes")
    _env_argument(s, "serve", "--inline-body-bytes", "MOPT_INLINE_BODY_BYTES", type=int, default=16 * 1024,
                  help="bodies up to this size are parsed on the event loop and their texts tokenized together "
                       "with the other small requests' in one call a loop turn, larger ones in the tokenizer "
                       "threads; 0: all in the threads (docs/server.md: the measured effect)")
    _env_argument(s, "serve", "--header-timeout", "MOPT_HEADER_TIMEOUT", type=float, default=10.0,
                  help="seconds from a connection's start (or a keep-alive request's first byte) to the end of "
                       "its headers; 408 and close beyond")
    _env_argument(s, "serve", "--engine-stall-timeout", "MOPT_ENGINE_STALL_TIMEOUT", type=float, default=5.0,
                  help="seconds an engine call (or the idle worker's 1 s ping) may take, at least, before the engine "
                       "counts as stalled: /health fails and the server exits 71 (the deadline is 4x a call's "
                       "expected time when that is longer)")
    _env_argument(s, "serve", "--max-header-bytes", "MOPT_MAX_HEADER_BYTES", type=int, default=16 * 1024,
                  help="request line and headers, each bounded by this (414/431 beyond)")
    _env_argument(s, "serve", "--request-timeout", "MOPT_REQUEST_TIMEOUT", type=float, default=60.0,
                  help="seconds for a request from the end of its headers: reading its body, queueing and computing")
    _env_argument(s, "serve", "--idle-timeout", "MOPT_IDLE_TIMEOUT", type=float, default=15.0,
                  help="seconds a keep-alive connection may wait for its next request")
    _env_argument(s, "serve", "--drain-timeout", "MOPT_DRAIN_TIMEOUT", type=float, default=8.0,
                  help="seconds in-flight requests get after SIGTERM; keep it under the stop timeout "
                       "(docker stop: 10 s, Kubernetes terminationGracePeriodSeconds: 30 s)")
    _env_argument(s, "serve", "--log-format", "MOPT_LOG_FORMAT", default="text", choices=("text", "json"),
                  help="json: one JSON object per log line (access lines at MOPT_LOG_LEVEL=INFO)")

    _model_arguments(s, "serve")

    w = sub.add_parser("warm", help="compile a mounted model's engine into --cache-dir ahead of the first start")
    _model_arguments(w, "warm")

    t = sub.add_parser("make-tiny-qwen3", help="write a tiny random Qwen3 checkpoint + tokenizer")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    return p


def cmd_compile(a) -> dict:
    from dataclasses import fields, replace

    from .compiler import DEFAULT_MIN_COSINE, compile_engine
    from .conventions import apply_conventions
    from .params import EngineParams

    image = _load_json_arg("--image-info", a.image_info, dict)
    texts = _load_json_arg("--reference-texts", a.reference_texts, list)
    model = Path(a.model)
    if not model.is_dir():
        raise UsageError(f"--model {model}: not a directory")
    flags = {f.name: getattr(a, f.name) for f in fields(EngineParams) if hasattr(a, f.name)}
    if a.params is not None:
        if flags:
            raise UsageError(f"--params holds the engine parameters: drop {', '.join(sorted(flags))}")
        params = EngineParams.read(a.params)
        given = set(json.loads(Path(a.params).read_text(encoding="utf-8")))  # read() checked it already
    else:
        params = EngineParams(**flags)
        given = set(flags)
    # Pooling and normalisation from the model's own sentence-transformers files (conventions.py).
    params = apply_conventions(params, model, given, force=a.force_pooling)
    params = replace(params, model_dir=str(model.resolve()),
                     model_name=params.model_name or (image or {}).get("repository") or model.resolve().name)
    min_cosine = DEFAULT_MIN_COSINE if a.min_cosine is None else a.min_cosine
    if not -1.0 <= min_cosine <= 1.0:
        raise UsageError(f"--min-cosine must be in -1..1, got {a.min_cosine}")
    extra = {"cache": {"key": a.cache_key}} if a.cache_key else None
    return compile_engine(model, a.out, params, target_sm=a.target_sm, image=image,
                          reference_texts=texts, verify=a.verify, min_cosine=min_cosine, extra=extra)


def cmd_check(a) -> dict:
    from .guard import resolve

    engine_dir, data = resolve(a.engine_dir)
    return {"status": "ok", "engine_dir": str(engine_dir), "backend": data["backend"],
            "device": data["device"], "target_sm": data["target_sm"], "engine_sha256": data["engine_sha256"]}


def cmd_doctor(a) -> None:
    """The host as the engine would meet it, as one JSON line on stdout; a problem is also one line on stderr,
    exit 3. With an engine (engine.json in --engine-dir), the start-up guard decides: it knows the engine's
    device and arch. Without one, a CUDA build of torch that finds no usable GPU is the problem."""
    from .guard import resolve
    from .hostinfo import host_facts

    facts = host_facts()
    found = {"torch": facts.torch, "torch_cuda": facts.cuda, "gpu": facts.gpu_name, "sm": facts.sm,
             "driver": facts.driver, "image_requires": os.environ.get("NVIDIA_REQUIRE_CUDA") or None,
             "engine": None}
    problem = facts.gpu_problem if facts.cuda and not facts.sm else None
    if a.engine_dir and (Path(a.engine_dir) / "engine.json").is_file():
        try:
            _, data = resolve(a.engine_dir)
            found["engine"] = {key: data[key] for key in ("backend", "device", "target_sm")}
            problem = None  # the guard passed: this host serves this engine
        except GuardError as err:
            problem = err.message
    print(json.dumps(found | {"problem": problem}, sort_keys=True), flush=True)
    if problem:
        raise GuardError(problem)


# The serve flags as HttpOptions.
def http_options(a):
    """HttpOptions from the serve flags."""
    from .server import HttpOptions

    if a.api_key is not None and a.api_key_file is not None:
        raise UsageError("give --api-key or --api-key-file (MOPT_API_KEY or MOPT_API_KEY_FILE), not both")
    key = a.api_key
    if a.api_key_file is not None:
        try:
            key = Path(a.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--api-key-file: {exc}") from None
    if key is not None and not key.strip():
        raise UsageError("the API key is empty (--api-key, --api-key-file or their variables)")
    origins = tuple(o.strip() for o in a.cors_origins.split(",") if o.strip())
    if a.max_inflight_bytes < a.max_body_bytes:
        raise UsageError("--max-inflight-bytes must be at least --max-body-bytes (one largest request must fit)")
    return HttpOptions(api_key=key, metrics_auth=a.metrics_auth, cors_origins=origins,
                       max_connections=a.max_connections, max_header_bytes=a.max_header_bytes,
                       request_timeout_s=a.request_timeout, idle_timeout_s=a.idle_timeout,
                       header_timeout_s=a.header_timeout, drain_timeout_s=a.drain_timeout,
                       max_inflight_bytes=a.max_inflight_bytes, tokenizer_threads=a.tokenizer_threads,
                       inline_body_bytes=a.inline_body_bytes,
                       json_logs=a.log_format == "json")


def cmd_serve(a) -> int:
    from . import fingerprint
    from .backends import backend_info, get_backend
    from .engine import Engine
    from .metrics import Metrics
    from .modelcache import locate
    from .server import configure_logging, serve
    from .service import EmbeddingService, ServerLimits

    options = http_options(a)
    configure_logging(options.json_logs, os.environ.get("MOPT_LOG_LEVEL", "WARNING"))
    if a.model_id and a.engine_dir and a.engine_dir != os.environ.get("MOPT_ENGINE_DIR"):
        raise UsageError("give --engine-dir or --model-id, not both (a baked image's MOPT_ENGINE_DIR gives way to "
                         "--model-id)")
    if a.model_id:  # a mounted model: its engine comes from the cache, compiled there on a miss
        target = _model_source(a)
        params, names = target.params.to_dict(), a.served_model_name or (target.params.model_name,)
    elif a.engine_dir:
        target, names = a.engine_dir, a.served_model_name or ()
        params = fingerprint.read(a.engine_dir)["params"]
    else:
        raise UsageError("give --engine-dir (MOPT_ENGINE_DIR) or --model-id (MOPT_MODEL_ID)")
    if backend_info(params["backend"]).own_server:  # tensorrt-llm: the guard, then its OpenAI server
        engine_dir, data = locate(target)  # refuse (exit 3) before loading anything
        get_backend(data["backend"]).exec_serve(engine_dir, data, a.host, a.port, options=options)
        return 0
    limits = ServerLimits(max_batch=a.max_batch or params["max_batch"], max_wait_ms=a.max_wait_ms,
                          max_batch_tokens=a.max_batch_tokens,
                          max_inputs=a.max_inputs, max_input_tokens=a.max_input_tokens,
                          max_body_bytes=a.max_body_bytes, max_input_chars=a.max_input_chars,
                          max_request_tokens=a.max_request_tokens, max_queue_tokens=a.max_queue_tokens,
                          auto_truncate=a.auto_truncate, request_timeout_s=a.request_timeout,
                          engine_ping_s=1.0, engine_stall_s=a.engine_stall_timeout, engine_depth=a.engine_depth,
                          batch_quiet_ms=a.batch_quiet_ms, served_model_names=names)
    if a.engine_depth < 1 or a.batch_quiet_ms < 0:
        raise UsageError("--engine-depth must be >= 1 and --batch-quiet-ms >= 0")
    if a.engine_stall_timeout <= 0:
        raise UsageError("--engine-stall-timeout must be > 0")
    if limits.max_batch < 1 or limits.max_inputs < 1:
        raise UsageError("--max-batch and --max-inputs must be >= 1")
    os.environ["MOPT_CUDA_GRAPHS"] = "1" if a.cuda_graphs else "0"  # read where the engine loads (the worker too)
    metrics = Metrics()
    # The server listens while the engine loads: /health says "loading", /ready 503 until it is done.
    if a.engine_process and not backend_info(params["backend"]).concurrent_calls:
        # the guard (or the cache's compile), the load and the forward passes in a worker (worker.py says
        # why); an engine whose forward passes run in a process of its own (vLLM) needs no worker in between
        from .worker import EngineProcess

        return serve(None, a.host, a.port, options, metrics=metrics,
                     load=lambda: EmbeddingService(EngineProcess(target).start(), limits, metrics))
    if a.model_id:  # compiled (if need be) while the server listens and /ready says no
        return serve(None, a.host, a.port, options, metrics=metrics,
                     load=lambda: EmbeddingService(Engine.from_info(*locate(target)), limits, metrics))
    engine_dir, data = locate(target)  # refuse (exit 3) before loading anything
    return serve(None, a.host, a.port, options, metrics=metrics,
                 load=lambda: EmbeddingService(Engine.from_info(engine_dir, data), limits, metrics))


def cmd_warm(a) -> dict:
    from .modelcache import resolve_cached

    if not a.model_id:
        raise UsageError("warm needs --model-id (MOPT_MODEL_ID)")
    result = resolve_cached(_model_source(a))
    return {"engine_dir": str(result.engine_dir), "key": result.key, "outcome": result.outcome,
            "seconds": result.seconds, "backend": result.data["backend"], "device": result.data["device"],
            "target_sm": result.data["target_sm"], "engine_sha256": result.data["engine_sha256"]}


def cmd_tiny(a) -> dict:
    from .fingerprint import sha256_file
    from .tiny_qwen3 import make_tiny_qwen3

    out = make_tiny_qwen3(a.out, a.seed)
    return {"out": str(out), "seed": a.seed, "model_sha256": sha256_file(out / "model.safetensors")}


COMMANDS = {"compile": cmd_compile, "check": cmd_check, "doctor": cmd_doctor, "serve": cmd_serve,
            "warm": cmd_warm, "make-tiny-qwen3": cmd_tiny}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before any backend loads libcuda (cudacompat.py says why).
    if args.command in ("serve", "check", "doctor", "warm"):
        reexec_if_needed(None if argv is None else [sys.executable, "-m", __package__ or "mopt_runtime", *argv])
    logging.basicConfig(level=os.environ.get("MOPT_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = COMMANDS[args.command](args)
    except RuntimeToolError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as err:  # a serving image leaves out what only the compile needs
        print(f"error: {args.command} needs the Python package {err.name!r}, which this image does not ship (a "
              "serving image leaves out what only the compile needs; the model runtime image has it: "
              "docs/hardening.md)", file=sys.stderr)
        return UsageError.exit_code
    if isinstance(result, int):  # serve's exit code (non-zero: the engine worker died)
        # The drain has used most of Docker's 10 s; the interpreter's teardown would then garbage-collect
        # every object torch and vLLM made (1.7 s measured with vLLM's client in this process). Frozen
        # objects are left to the process's exit; atexit handlers still run.
        gc.freeze()
        return result
    if result is not None:
        print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
