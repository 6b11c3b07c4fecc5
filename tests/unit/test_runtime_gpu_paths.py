"""CPU coverage of the code paths the H200 runs used: the torch-inductor backend in both its forms
(the standalone Inductor artifact, loaded without tracing; the cache form it falls back to), the
guard over their files, batch-1 padding, and benchmarks/gpu_bench.py: its arguments and model shape,
and a tiny run of it (torch-aot engine, JIT with dynamic shapes and the engines' SDPA kernels).
torch-aot's own paths (the fresh-process load check, the loader without Inductor) are covered in
test_runtime_qwen3.py."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the runtime needs torch")
pytest.importorskip("transformers", reason="the runtime needs transformers")

from builder.runtime import fingerprint, guard  # noqa: E402
from builder.runtime.backends import get_backend  # noqa: E402
from builder.runtime.compiler import compile_engine, cosine  # noqa: E402
from builder.runtime.engine import Engine  # noqa: E402
from builder.runtime.errors import GuardError  # noqa: E402
from builder.runtime.params import EngineParams  # noqa: E402
from builder.runtime.tiny_qwen3 import make_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.runtime
REPO = Path(__file__).resolve().parents[2]
TEXTS = ["hello world", "the cat is on the tree", "paris is the capital of france"]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(tmp_path_factory, name: str, attention: str = "mask", **env):
    tiny = make_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    out = tmp_path_factory.mktemp(name) / "out"
    params = EngineParams(backend="torch-inductor", max_batch=4, max_seq_len=32, pooling="last",
                          model_dir=str(tiny), attention=attention)
    with pytest.MonkeyPatch.context() as patch:  # module-scoped fixtures cannot take monkeypatch
        for key, value in env.items():
            patch.setenv(key, value)
        summary = compile_engine(tiny, out, params, reference_texts=TEXTS)
    return out, summary


@pytest.fixture(scope="module")
def artifact_engine(tmp_path_factory):
    # As qwen3-embed's CUDA flavour compiles it: causal attention, SDPA without cuDNN.
    return _compile(tmp_path_factory, "artifact", attention="causal")


@pytest.fixture(scope="module")
def cache_engine(tmp_path_factory):
    return _compile(tmp_path_factory, "cache", MOPT_INDUCTOR_ARTIFACT="0")


def _check_embeddings(out: Path) -> None:
    eng = Engine.open(out)
    one = [eng.embed_texts([t])[0] for t in TEXTS]  # batch 1 (padded to 2) and batch 3 agree
    many = eng.embed_texts(TEXTS)
    assert min(cosine(a, b) for a, b in zip(one, many, strict=True)) > 0.9999
    ref = json.loads((out / "reference.json").read_text())["embeddings"][:len(TEXTS)]  # the gate's texts follow
    assert min(cosine(a, b) for a, b in zip(many, ref, strict=True)) > 0.999


def test_artifact_engine_loads_without_tracing_and_matches_reference(artifact_engine, tmp_path, monkeypatch):
    import torch

    out, summary = artifact_engine
    assert summary["engine_min_cosine"] >= 0.999
    data = fingerprint.read(out)
    files = data["engine_files"]
    assert data["artifact"] == "compile_cache.json" and data["engine_sha256"] == files["compile_cache.json"]
    assert {"weights/config.json", "inductor-artifact.bin", "graph.json",
            "graph-tensors-00001.safetensors"} <= set(files)
    assert "weights/model.safetensors" not in files  # the graph tensors are the weights: not shipped twice
    # the cache a fresh load of the artifact writes, its kernels built at compile time
    assert any(f.startswith("inductor-cache/") and f.endswith(".so") for f in files)
    manifest = json.loads((out / "engine" / "compile_cache.json").read_text())
    assert manifest["form"] == "artifact" and manifest["artifact"]["check_cosine"] >= 0.99
    # Causal attention left no mask tensor in the graph, and cuDNN's SDPA was not allowed in.
    assert manifest["artifact"]["sdpa_calls"] == 2 and manifest["artifact"]["sdpa_with_mask"] == 0
    assert manifest["artifact"]["sdpa_backends"] == ["flash", "efficient", "math"]
    assert data["params"]["attention"] == "causal" and not Engine.open(out).encoder.pad_left
    monkeypatch.setenv("MOPT_COMPILE_CACHE_DIR", str(tmp_path / "rt"))
    # Dynamo must not run at all on this path: make any attempt to trace fail loudly.
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile called on the artifact path"))
    _check_embeddings(out)
    assert get_backend("torch-inductor").LAST_LOAD_PATH == "artifact"


def test_artifact_path_builds_no_module_and_imports_no_transformers(artifact_engine, tmp_path):
    """The image's start-up path in a fresh process: guard, tensors to the device, artifact; a first
    embedding without transformers (its import and from_pretrained cost seconds at start)."""
    import subprocess
    import sys

    out, _ = artifact_engine
    code = ("import sys, json; from builder.runtime.engine import Engine; "
            f"e = Engine.open({str(out)!r}); v = e.embed_texts(['hello world'])[0]; "
            "import builder.runtime.backends.torch_inductor as t; "
            "print(json.dumps({'dim': len(v), 'path': t.LAST_LOAD_PATH, "
            "'transformers': 'transformers' in sys.modules}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "MOPT_COMPILE_CACHE_DIR": str(tmp_path / "rt")})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"dim": 64, "path": "artifact", "transformers": False}
    # nothing executable was written at start: every kernel came through a link into the engine dir
    runtime = tmp_path / "rt" / "cache"
    kernels = [p for p in runtime.rglob("*.so")]
    assert kernels and all(p.is_symlink() for p in kernels), [p for p in kernels if not p.is_symlink()]
    assert all(p.resolve().is_relative_to((out / "engine").resolve()) for p in kernels)


@pytest.mark.timeout(120)
def test_the_loaders_own_cache_dir_is_removed_at_exit(tmp_path):
    """Without MOPT_COMPILE_CACHE_DIR the loader makes a temp dir for its writable cache: gone when the
    process ends (each test run left 9 MB a load in /tmp). One given by the caller is the caller's: kept."""
    import os
    import subprocess
    import sys

    (tmp_path / "tmp").mkdir()
    code = ("import sys; from pathlib import Path; "
            "from builder.runtime.backends.torch_inductor import runtime_cache_dir; "
            "d = runtime_cache_dir(Path(sys.argv[1])); (d / 'kernel.so').write_bytes(b'x'); print(d)")
    env = {k: v for k, v in os.environ.items() if k != "MOPT_COMPILE_CACHE_DIR"}
    runs = {}
    for name, extra in (("own", {}), ("given", {"MOPT_COMPILE_CACHE_DIR": str(tmp_path / "given")})):
        res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "engine")], cwd=REPO, capture_output=True,
                             text=True, timeout=100, env={**env, "TMPDIR": str(tmp_path / "tmp"), **extra})
        assert res.returncode == 0, res.stderr[-2000:]
        runs[name] = Path(res.stdout.strip().splitlines()[-1])
    assert runs["own"].is_relative_to(tmp_path / "tmp") and not runs["own"].parent.exists()
    assert not list((tmp_path / "tmp").glob("mopt-inductor-*"))
    assert runs["given"] == tmp_path / "given" / "cache" and (runs["given"] / "kernel.so").is_file()


def test_artifact_from_another_torch_falls_back_to_jit(artifact_engine, tmp_path, monkeypatch):
    import shutil

    out, _ = artifact_engine
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    blob = copy / "engine" / "inductor-artifact.bin"
    blob.write_bytes(blob.read_bytes()[:64])  # unreadable as this torch's artifact
    mod = get_backend("torch-inductor")
    with monkeypatch.context() as m:
        m.setenv("MOPT_COMPILE_CACHE_DIR", str(tmp_path / "rt"))
        run = mod.load(copy / "engine", EngineParams.from_dict(fingerprint.read(out)["params"]))
    assert mod.LAST_LOAD_PATH == "jit"
    import torch

    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    assert run(ids, torch.ones_like(ids)).shape[0] == 2


def test_cache_form_ships_the_caches_and_matches_reference(cache_engine, tmp_path, monkeypatch):
    out, summary = cache_engine
    assert summary["engine_min_cosine"] >= 0.999
    files = fingerprint.read(out)["engine_files"]
    assert "inductor-artifact.bin" not in files and any(f.startswith("inductor-cache/") for f in files)
    manifest = json.loads((out / "engine" / "compile_cache.json").read_text())
    assert manifest["form"] == "cache" and manifest["warmup"]
    monkeypatch.setenv("MOPT_COMPILE_CACHE_DIR", str(tmp_path / "rt"))
    _check_embeddings(out)
    assert (tmp_path / "rt" / "cache").is_dir()
    assert get_backend("torch-inductor").LAST_LOAD_PATH == "cache"


@pytest.mark.parametrize("which", ["artifact-file", "cache-file"])
def test_guard_covers_every_engine_file(which, artifact_engine, cache_engine):
    out, _ = artifact_engine if which == "artifact-file" else cache_engine
    files = sorted(fingerprint.read(out)["engine_files"])
    name = "inductor-artifact.bin" if which == "artifact-file" else next(f for f in files
                                                                         if f.startswith("inductor-cache/"))
    victim = out / "engine" / name
    original = victim.read_bytes()
    try:
        victim.write_bytes(original + b"#")
        with pytest.raises(GuardError, match="sha256 differs"):
            guard.check(out)
    finally:
        victim.write_bytes(original)
    guard.check(out)


def test_single_row_is_padded_to_two_rows():
    import torch

    mod = get_backend("torch-inductor")
    seen = []

    def fake(ids, mask):
        seen.append(tuple(ids.shape))
        return ids.float().sum(dim=1, keepdim=True)

    ids = torch.tensor([[3, 4, 5]])
    out = mod._call(fake, ids, torch.ones_like(ids))
    assert seen == [(2, 3)] and out.shape == (1, 1) and out.item() == 12.0
    assert mod._call(fake, torch.ones(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)).shape == (3, 1)
    assert mod.warmup_shapes(EngineParams(max_batch=64, max_seq_len=512)) == [(2, 16)]


def test_sdpa_backends_from_the_environment(monkeypatch):
    from builder.runtime import sdpa as mod
    from builder.runtime.errors import UsageError

    monkeypatch.delenv(mod.ENV_SDPA, raising=False)
    assert mod.sdpa_backends() == ["flash", "efficient", "math"]
    monkeypatch.setenv(mod.ENV_SDPA, "cudnn, flash")
    assert mod.sdpa_backends() == ["cudnn", "flash"]
    monkeypatch.setenv(mod.ENV_SDPA, "flash,tensorcores")
    with pytest.raises(UsageError, match="MOPT_SDPA_BACKENDS: tensorcores not among"):
        mod.sdpa_backends()


def test_bench_arguments_and_qwen3_config():
    bench = _bench()
    a = bench.parse_args(["--out", "x"])
    assert (a.layers, a.batch, a.seq, a.precision, a.device) == (28, 64, 512, "bf16", "cuda")
    assert a.engines == "default/causal/aot" and set(bench.VARIANTS) == {"cudnn", "aot", "aot16", "aotfuse"}
    assert bench.VARIANTS["aot"]["backend"] == "torch-aot"
    mode, attention, backend, env = bench.engine_spec("default/causal/aot16+cudnn")  # envs merge
    assert (mode, attention, backend) == ("default", "causal", "torch-aot")
    assert env == {"CXX": "g++", "MOPT_TUNE_SHAPE": "2x16", "MOPT_SDPA_BACKENDS": "cudnn,flash,efficient,math"}
    assert bench.engine_spec("default/mask") == ("default", "mask", "torch-inductor", None)
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        bench.engine_spec("default/causal/aot+fast")
    cfg = bench.model_config(a.layers)
    assert cfg == {"vocab_size": 151669, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1e6,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    assert bench.model_config(8)["num_hidden_layers"] == 8 and bench.model_config(2, tiny=True)["hidden_size"] == 64
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu"])  # bf16 on cpu is refused


def test_bench_tiny_run_on_cpu(tmp_path):
    """gpu_bench.py end to end at tiny size on the CPU: a torch-aot engine measured in fresh processes,
    a torch.compile JIT with symbolic sizes and the engines' SDPA kernel list (also on mixed-length
    traffic), and one of the exported graph."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", "--tiny", "--layers", "2", "--device", "cpu",
                           "--precision", "fp32", "--batch", "4", "--seq", "32", "--engines", "default/causal/aot",
                           "--jit", "default/causal/dynamic/flash,default/causal/dynamic/exported",
                           "--skip", "guard,server,accuracy",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (res["compile[default/causal/aot]"]["backend"], res["compile[default/causal/aot]"]["tuned_for"]) == (
        "torch-aot", "4x32")
    engine = res["engine[default/causal/aot]"]
    assert engine["load_path"] == "torch-aot" and engine["dim"] == 64 and engine["engine_tok_s"] > 0
    assert res["start_steps"]["backend"] == "torch-aot" and "backend load" in res["start_steps"]["steps_s"]
    jit = res["jit[default/causal/dynamic/flash]"]
    assert (jit["shapes"], jit["sdpa"], jit["attention"]) == ("dynamic", "flash,efficient,math", "causal")
    assert jit["jit_tok_s"] > 0 and jit["graph"] == "module" and jit["rotary"] == "product"
    # the same mixed-length traffic as the engine's, through the same batching
    assert jit["mixed_texts"] == engine["mixed_texts"] == 512 and jit["mixed_tok_s"] > 0
    assert jit["mixed_first_pass_tok_s"] > 0 and engine["mixed_first_pass_tok_s"] > 0
    exported = res["jit[default/causal/dynamic/exported]"]  # the engines' exported graph, JIT-compiled
    assert (exported["graph"], exported["sdpa"]) == ("exported", "free") and exported["jit_tok_s"] > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device, threads", [("cuda", 1), ("cpu", None)])
def test_a_gpu_engine_loads_with_one_intra_op_thread(monkeypatch, device, threads):
    """A GPU engine's small CPU copies woke OpenMP's pool, whose threads then spun at ~50% CPU each on
    the H200 host (docs/performance.md, runs 6-7): a cuda engine sets one intra-op thread, a cpu engine
    keeps them all for its forward pass."""
    import torch

    from builder.runtime import engine as engine_module

    class Backend:
        def load(self, engine_dir, params):
            return lambda ids, mask: None

    monkeypatch.setattr(engine_module, "get_backend", lambda name: Backend())
    monkeypatch.setattr(engine_module, "engine_encoder", lambda out_dir, params: None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = EngineParams(device=device, precision="bf16" if device == "cuda" else "fp32")
        Engine.from_info("unused", {"params": params.to_dict()}, params)
        assert torch.get_num_threads() == (threads or 2)
    finally:
        torch.set_num_threads(before)
