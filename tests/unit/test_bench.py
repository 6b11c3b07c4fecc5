"""mopt bench without Docker: the workload (seeded, repeatable, bounded), both APIs' answers checked,
targets (loopback or --allow-host only), the load generator's runs and error kinds against a stand-in
server (tests/benchstub.py: the real images are benched in tests/integration/test_vllm_cpu.py), the
sweep's answer, the result files, and the CLI's exit codes."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import socket
import statistics
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from builder.bench import hostload, output
from builder.bench.api import OPENAI, TEI, BadAnswer
from builder.bench.load import Load, Run
from builder.bench.run import BenchResult, Settings, TargetResult, bench
from builder.bench.sweep import RESOLUTION, Step, Sweep, passes, sweep
from builder.bench.target import Target
from builder.bench.workload import Lengths, Workload, digest
from builder.errors import ConfigError
from tests.benchstub import DIMENSION, BenchStub
from tests.chromium import CHROMIUM, dump_dom
from tests.conftest import run_mopt


@pytest.fixture(autouse=True)
def quick_host_samples(monkeypatch):
    monkeypatch.setattr(hostload, "SAMPLE_S", 0.05)


# -- workload ---------------------------------------------------------------------------------------

def test_the_same_spec_draws_the_same_requests_and_another_seed_others():
    spec = Workload(Lengths.parse("lognormal:20"), batch=4, distinct=16, seed=7)
    first, again = spec.requests(), Workload(Lengths.parse("lognormal:20"), batch=4, distinct=16, seed=7).requests()
    assert first == again and digest(first) == digest(again)
    other = Workload(Lengths.parse("lognormal:20"), batch=4, distinct=16, seed=8).requests()
    assert digest(other) != digest(first)
    assert len(first) == 16 and all(len(batch) == 4 for batch in first)


def test_fixed_lengths_are_exact():
    requests = Workload(Lengths.parse("fixed:7"), batch=3, distinct=5).requests()
    assert [len(text.split()) for batch in requests for text in batch] == [7] * 15


def test_lognormal_lengths_centre_on_the_median_and_are_cut_to_max_words():
    narrow = Workload(Lengths.parse("lognormal:32:0.2"), batch=8, distinct=128, max_words=128).requests()
    wide = Workload(Lengths.parse("lognormal:32:1.5"), batch=8, distinct=128, max_words=128).requests()
    n = [len(t.split()) for b in narrow for t in b]
    w = [len(t.split()) for b in wide for t in b]
    assert 28 <= statistics.median(n) <= 36 and 24 <= statistics.median(w) <= 40
    assert max(w) == 128 and min(w) >= 1 and max(n) < 90  # cut at max_words; sigma sets the spread
    assert statistics.pstdev(w) > 3 * statistics.pstdev(n)


def test_file_lengths_sample_the_users_lines(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("alpha beta gamma\n\n  one two three four five six  \nzeta\n", encoding="utf-8")
    spec = Workload(Lengths.parse(f"file:{path}"), batch=4, distinct=8, max_words=4)
    texts = {t for b in spec.requests() for t in b}
    assert texts <= {"alpha beta gamma", "one two three four", "zeta"} and len(texts) == 3
    data = spec.to_json(spec.requests())
    assert data["lengths"] == f"file:{path}" and len(data["file_sha256"]) == 64
    assert data["words"]["max"] == 4 and data["words"]["min"] == 1


@pytest.mark.parametrize("text, says", [
    ("fixed", "use fixed:N"), ("fixed:0", "1..8192 words"), ("fixed:x", "invalid literal"),
    ("fixed:9000", "1..8192"), ("lognormal:10:0", "sigma must be in"), ("lognormal:10:9", "sigma must be in"),
    ("lognormal:10:nan", "sigma must be in"), ("lognormal:1:2:3", "use fixed:N"), ("gauss:3", "use fixed:N"),
    ("file:", "no path after file:"),
])
def test_bad_length_specs_are_refused_in_one_line(text, says):
    with pytest.raises(ConfigError, match=re.escape(says)) as caught:
        Lengths.parse(text)
    assert "--lengths" in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize("field, value", [("batch", 0), ("batch", 2049), ("max_words", 0), ("max_words", 8193),
                                          ("distinct", 0), ("distinct", 4097), ("seed", -1)])
def test_workload_bounds(field, value):
    with pytest.raises(ConfigError, match="must be"):
        Workload(Lengths.parse("fixed:3"), **{field: value})


def test_file_problems_are_one_line(tmp_path, monkeypatch):
    empty, binary, big = tmp_path / "empty", tmp_path / "binary", tmp_path / "big"
    empty.write_text("\n  \n")
    binary.write_bytes(b"\xff\xfe\x00bad")
    big.write_text("word " * 100)
    monkeypatch.setattr("builder.bench.workload.MAX_FILE_BYTES", 64)
    for path, says in ((tmp_path / "missing", "cannot read it"), (empty, "no non-empty line"),
                       (binary, "as UTF-8"), (big, "more than 64")):
        with pytest.raises(ConfigError, match=says):
            Workload(Lengths.parse(f"file:{path}")).requests()


def test_a_result_repeats_its_workload(tmp_path):
    spec = Workload(Lengths.parse("lognormal:12:0.5"), batch=2, max_words=40, distinct=9, seed=3)
    data = spec.to_json(spec.requests())
    (tmp_path / "bench.json").write_text(json.dumps({"workload": data}))
    (tmp_path / "workload.json").write_text(json.dumps(data))
    for name in ("bench.json", "workload.json"):
        again, sha = Workload.from_json(tmp_path / name)
        assert again == spec and sha == data["sha256"] == digest(again.requests())
    (tmp_path / "bad.json").write_text('{"workload": {"lengths": "fixed:3"}}')
    with pytest.raises(ConfigError, match="not a mopt bench result"):
        Workload.from_json(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read it"):
        Workload.from_json(tmp_path / "absent.json")


# -- the APIs' answers ------------------------------------------------------------------------------

def _openai(vectors, usage=True) -> bytes:
    payload = {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
    return json.dumps(payload | ({"usage": {"prompt_tokens": 11}} if usage else {})).encode()


def test_good_answers_give_dimension_and_tokens():
    assert OPENAI.check(_openai([[0.1, 0.2], [0.3, 0.4]]), 2, {}) == (2, 11)
    assert OPENAI.check(_openai([[1, 2, 3]], usage=False), 1, {}) == (3, None)
    assert TEI.check(b"[[0.1, 0.2, 0.3]]", 1, {"x-compute-tokens": "5"}) == (3, 5)
    assert TEI.check(b"[[0.1]]", 1, {"x-compute-tokens": "-2"}) == (1, None)
    assert json.loads(OPENAI.body(["a", "b"], "m", "float")) == {"input": ["a", "b"], "model": "m"}
    assert json.loads(OPENAI.body(["a"], None, "float")) == {"input": ["a"]}
    assert json.loads(TEI.body(["a"], "m", "base64")) == {"inputs": ["a"]}
    assert TEI.check(b"[[0.1]]", 1, {"x-compute-tokens": "0"}) == (1, 0)
    assert json.loads(OPENAI.body(["a"], None, "base64")) == {"input": ["a"], "encoding_format": "base64"}
    b64 = base64.b64encode(struct.pack("<3f", 0.1, 0.2, 0.3)).decode()
    assert OPENAI.check(_openai([b64, b64]), 2, {}) == (3, 11)


@pytest.mark.parametrize("embedding, says", [
    ("not base64!", "an embedding is a string but not base64"),
    ("AAAAAA==!", "an embedding is a string but not base64"),  # valid but for one character: still refused
    (base64.b64encode(b"12345").decode(), "a base64 embedding of 5 bytes, not whole float32 values")])
def test_broken_base64_embeddings_are_wrong_answers(embedding, says):
    with pytest.raises(BadAnswer, match=f"^{re.escape(says)}$"):
        OPENAI.check(_openai([embedding]), 1, {})


def test_wrong_answer_messages_are_exact():
    with pytest.raises(BadAnswer, match=f"^not JSON: {re.escape(repr('x' * 120))}$"):
        OPENAI.check(b"x" * 300, 1, {})
    with pytest.raises(BadAnswer, match=r"^vectors of sizes \[1, 2, 3, 4\], not one dimension$"):
        OPENAI.check(_openai([[0.1] * n for n in (1, 2, 3, 4, 5)]), 5, {})
    with pytest.raises(BadAnswer, match="^a vector holds something other than numbers$"):
        OPENAI.check(_openai([["x"]]), 1, {})


@pytest.mark.parametrize("api, data, texts, says", [
    (OPENAI, b"<html>", 1, "not JSON"), (OPENAI, _openai([[0.1]]), 2, "1 vectors for 2 texts"),
    (OPENAI, b'{"data": 3}', 1, "int for 1 texts"), (OPENAI, b"[]", 1, "NoneType for 1 texts"),
    (OPENAI, _openai([[0.1], [0.1, 0.2]]), 2, "not one dimension"), (OPENAI, _openai([[]]), 1, "not one dimension"),
    (OPENAI, _openai([["x"]]), 1, "other than numbers"), (OPENAI, _openai([[True]]), 1, "other than numbers"),
    (OPENAI, b'{"data": [{"embedding": 5}]}', 1, "not one dimension"),
    (TEI, b'{"data": []}', 1, "dict for 1 texts"), (TEI, b"[[1.0], [1.0]]", 1, "2 vectors for 1 texts"),
])
def test_wrong_answers_say_what_is_wrong(api, data, texts, says):
    with pytest.raises(BadAnswer, match=re.escape(says)):
        api.check(data, texts, {})


# -- targets ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, name, ref", [
    ("http://127.0.0.1:8000/", "127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://localhost:9", "localhost:9", "http://localhost:9"),
    ("https://[::1]:8443/prefix/", "[::1]:8443", "https://[::1]:8443/prefix"),
    ("http://127.9.9.9", "127.9.9.9", "http://127.9.9.9"),
    ("tei=http://127.0.0.1:8080", "tei", "http://127.0.0.1:8080"),
])
def test_loopback_urls_are_targets(text, name, ref):
    assert Target.parse(text) == Target(name, ref, "url")


@pytest.mark.parametrize("text, name, ref", [
    ("mopt/minilm-embed:cpu", "minilm-embed:cpu", "mopt/minilm-embed:cpu"),
    ("a=127.0.0.1:5000/mopt/x:cu128-sm90", "a", "127.0.0.1:5000/mopt/x:cu128-sm90"),
    ("sha256:" + "a" * 64, "sha256:" + "a" * 57, "sha256:" + "a" * 64),
])
def test_images_are_targets(text, name, ref):
    assert Target.parse(text) == Target(name, ref, "image")


@pytest.mark.parametrize("text, says", [
    ("http://example.com:8000", "example.com is not a loopback address; mopt bench loads only loopback or hosts "
                                "you name as your own with --allow-host example.com"),
    ("http://0.0.0.0:8000", "0.0.0.0 is not a loopback"), ("http://10.0.0.1", "not a loopback"),
    ("http://user:pw@127.0.0.1:8000", "no credentials in the URL"), ("http://127.0.0.1/?x=1", "no query"),
    ("http://127.0.0.1/#top", "no query or fragment"), ("ftp://127.0.0.1/", "use http://HOST"),
    ("http://:8000", "use http://HOST"), ("http://127.0.0.1:99999", "Port out of range"),
    ("a b", "neither an http(s):// URL nor an image"), ("-rm", "neither"), ("x/../y", "neither"),
    ("bad name=http://127.0.0.1:1", "target name 'bad name'"),
])
def test_bad_or_foreign_targets_are_refused(text, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        Target.parse(text)


def test_allow_host_admits_the_users_own_host():
    assert Target.parse("http://Gpu-Box.lan:8000", ("gpu-box.lan",)).ref == "http://Gpu-Box.lan:8000"
    with pytest.raises(ConfigError, match="--allow-host other.lan"):
        Target.parse("http://other.lan:8000", ("gpu-box.lan",))


# -- the sweep --------------------------------------------------------------------------------------

def _fake_run(rate: float, p99: float, errors: dict | None = None) -> Run:
    return Run("open", rate, 100, 100, errors or {}, 10.0, 800, 2400, latencies_ms=(p99 / 2,) * 98 + (p99,) * 2)


def test_the_sweep_finds_the_highest_rate_under_the_target():
    capacity, target = 50.0, 200.0
    tried = []

    def measure(rate):  # an M/M/1-like server: latency grows without bound towards its capacity
        tried.append(rate)
        return _fake_run(rate, 20.0 * capacity / (capacity - min(rate, capacity - 0.01)))

    result = sweep(measure, peak_rate=48.0, p99_target_ms=target, steps=10)
    exact = capacity * (1 - 20.0 / target)  # 45 req/s
    assert exact - RESOLUTION * 48 * 2 <= result.answer <= exact
    passed = [s.rate for s in result.steps if s.passed]
    failed = [s.rate for s in result.steps if not s.passed]
    assert result.answer == max(passed) and all(f > result.answer for f in failed)
    assert tried[0] == 48.0 and len(result.steps) <= 10 and 0 < result.answer <= 48.0
    data = result.to_json()
    assert data["answer_rate"] == round(result.answer, 3) and len(data["steps"]) == len(tried)
    assert data["steps"][0]["passed"] is False and data["steps"][0]["latency_ms"]["p99"] > target


def test_a_server_that_holds_its_peak_needs_one_step_and_none_that_holds_nothing_answers_zero():
    held = sweep(lambda rate: _fake_run(rate, 10.0), peak_rate=30.0, p99_target_ms=100, steps=6)
    assert held.answer == 30.0 and len(held.steps) == 1
    never = sweep(lambda rate: _fake_run(rate, 1e6), peak_rate=30.0, p99_target_ms=100, steps=100)
    rates = [s.rate for s in never.steps]  # halved until the bracket is under 2% of the peak: 7 runs, not 100
    assert never.answer == 0.0 and rates == [30.0 / 2**i for i in range(7)]
    assert len(sweep(lambda rate: _fake_run(rate, 1e6), 30.0, 100, steps=3).steps) == 3


def test_errors_fail_a_rate_whatever_its_latency():
    assert passes(_fake_run(5, 10.0), 100) and not passes(_fake_run(5, 10.0, {"http_503": 1}), 100)
    assert not passes(_fake_run(5, 100.5), 100) and passes(_fake_run(5, 100.0), 100)
    assert not passes(Run("open", 5, 3, 0, {}, 1.0, 0, None), 100)


# -- load against a stand-in server ----------------------------------------------------------------

def _load(stub: BenchStub, api=OPENAI, *, texts=2, distinct=3, timeout_s=5.0, max_in_flight=64, api_key=None,
          model=None, base=None, encoding="float") -> Load:
    requests = [[f"text {i} {j}" for j in range(texts)] for i in range(distinct)]
    return Load(base or stub.endpoint, api, [api.body(r, model, encoding) for r in requests],
                [len(r) for r in requests], api_key=api_key, timeout_s=timeout_s, max_in_flight=max_in_flight)


def test_closed_loop_counts_requests_texts_and_tokens():
    with BenchStub(tokens_per_text=5) as stub:
        run = asyncio.run(_load(stub, texts=3).closed(4, duration_s=30, max_requests=40))
    assert (run.sent, run.ok, run.errors, stub.seen) == (40, 40, {}, 40)
    assert run.texts == 120 and run.tokens == 600 and run.latencies_ms == tuple(sorted(run.latencies_ms))
    assert run.requests_per_s == pytest.approx(40 / run.wall_s) and run.tokens_per_s == pytest.approx(600 / run.wall_s)
    assert run.wall_s < 10  # ended by the request bound, not the duration


def test_closed_loop_ends_at_its_duration():
    with BenchStub(delay_s=0.05) as stub:
        started = time.monotonic()
        run = asyncio.run(_load(stub).closed(2, duration_s=0.6, max_requests=10_000))
    assert 8 <= run.ok <= 26 and time.monotonic() - started < 2.5
    assert min(run.latencies_ms) >= 50


def test_open_loop_arrivals_follow_the_rate_and_latency_counts_from_the_arrival():
    with BenchStub(delay_s=0.1) as stub:
        run = asyncio.run(_load(stub).open(40, duration_s=1.0, max_requests=10_000, seed=1))
        again = asyncio.run(_load(stub).open(40, duration_s=1.0, max_requests=10_000, seed=1))
    assert 20 <= run.sent <= 65 and run.sent == again.sent  # Poisson, seeded
    assert run.ok == run.sent and run.errors == {} and min(run.latencies_ms) >= 100
    assert run.mode == "open" and run.label == "40 req/s offered"


def test_open_loop_past_its_in_flight_bound_counts_backlog():
    with BenchStub(delay_s=0.4) as stub:
        run = asyncio.run(_load(stub, max_in_flight=2).open(30, duration_s=1.0, max_requests=10_000, seed=2))
    assert run.errors.get("backlog", 0) >= 10 and run.ok <= 8 and run.ok + run.errors["backlog"] == run.sent
    assert stub.seen == run.ok


@pytest.mark.parametrize("mode, kind", [("status", "http_503"), ("garbage", "bad_response"), ("count", "bad_response"),
                                        ("ragged", "bad_response"), ("huge", "bad_response"),
                                        ("hangup", "connection")])
def test_each_wrong_answer_counts_as_its_kind(mode, kind):
    with BenchStub(mode=mode) as stub:
        run = asyncio.run(_load(stub).closed(2, duration_s=30, max_requests=6))
    assert run.ok == 0 and run.errors == {kind: 6} and run.percentile(99) is None and run.tokens is None


def test_a_slow_server_times_out_and_a_closed_port_refuses():
    with BenchStub(delay_s=1.5) as stub:
        slow = asyncio.run(_load(stub, timeout_s=1.0).closed(2, duration_s=30, max_requests=2))
    assert slow.errors == {"timeout": 2}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with BenchStub() as stub:
        refused = asyncio.run(_load(stub, base=f"http://127.0.0.1:{port}").closed(1, 30, 3))
    assert refused.errors == {"connection": 3}


def test_the_api_key_and_model_reach_the_server_and_tei_bodies_use_inputs():
    with BenchStub(tokens_per_text=2) as stub:
        asyncio.run(_load(stub, api_key="k-123", model="m").closed(1, 30, 2))
        tei = asyncio.run(_load(stub, TEI).closed(1, 30, 2))
    assert stub.auth[:2] == ["Bearer k-123"] * 2 and stub.bodies[0]["model"] == "m"
    assert stub.bodies[2] == {"inputs": ["text 0 0", "text 0 1"]} and stub.auth[2] is None
    assert tei.ok == 2 and tei.tokens == 8


def test_base64_answers_are_counted_and_the_clients_cpu_is_measured():
    with BenchStub(tokens_per_text=1) as stub:
        run = asyncio.run(_load(stub, encoding="base64").closed(2, duration_s=30, max_requests=20))
    assert run.ok == 20 and run.errors == {} and stub.bodies[0]["encoding_format"] == "base64"
    assert 0 < run.client_cpu < 2 and run.to_json()["client_cpu"] == round(run.client_cpu, 3)


def test_percentiles_are_nearest_rank():
    run = Run("closed", 1, 100, 100, {}, 1.0, 100, None, latencies_ms=tuple(float(i) for i in range(1, 101)))
    assert [run.percentile(q) for q in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    data = run.to_json()
    assert data["latency_ms"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert data["tokens_per_s"] is None and data["requests_per_s"] == 100.0 and data["texts_per_s"] == 100.0


# -- whole benches, in process ---------------------------------------------------------------------

QUICK = dict(clients=(1, 3), duration_s=1.0, warmup=2, sweep_steps=3)


def test_a_busy_load_generator_is_warned_about(monkeypatch):
    monkeypatch.setattr("builder.bench.run.CLIENT_CPU_WARN", 0.0)
    with BenchStub() as stub:
        result = bench([Target.parse(stub.endpoint)], Workload(Lengths.parse("fixed:2"), distinct=2),
                       Settings(clients=(1, 2), duration_s=1.0, warmup=0))
    warnings = [w for w in result.targets[0].warnings if w.startswith("the load generator used")]
    assert len(warnings) == 1 and "in the 1 clients run" in warnings[0]


def test_two_servers_side_by_side_with_their_apis_found():
    workload = Workload(Lengths.parse("fixed:5"), batch=2, distinct=4)
    with BenchStub(delay_s=0.01) as openai, BenchStub(mode="tei-only", delay_s=0.03) as tei:
        result = bench([Target.parse(f"a={openai.endpoint}"), Target.parse(f"b={tei.endpoint}")], workload,
                       Settings(**QUICK, sweep_p99_ms=500, api_key="secret-key-9"))
    a, b = result.targets
    assert (a.api, b.api, a.dimension, b.dimension) == ("openai", "tei", DIMENSION, DIMENSION)
    assert not a.error and not b.error and len(a.runs) == 2 and a.sweep is not None
    data = json.loads(json.dumps(result.to_json()))
    assert "secret-key-9" not in json.dumps(data) and data["settings"]["api_key"] is True
    assert data["workload"]["sha256"] == digest(workload.requests())
    assert [t["name"] for t in data["targets"]] == ["a", "b"]
    assert set(data["targets"][0]["host_load"]) == {"before", "after"}
    assert data["targets"][0]["sweep"]["answer_rate"] > 0
    assert a.runs[1].requests_per_s > a.runs[0].requests_per_s * 1.5  # 3 clients outpace 1 on a sleeping server


@pytest.mark.parametrize("mode, says", [("garbage", "did not answer as an embeddings server: not JSON"),
                                        ("count", "did not answer as an embeddings server: 0 vectors for 1 texts"),
                                        ("status", "HTTP 503")])
def test_a_server_that_answers_wrongly_is_one_failed_target(mode, says):
    workload = Workload(Lengths.parse("fixed:2"), batch=1, distinct=2)
    with BenchStub(mode=mode) as bad, BenchStub() as good:
        result = bench([Target.parse(f"bad={bad.endpoint}"), Target.parse(f"good={good.endpoint}")], workload,
                       Settings(**QUICK | {"clients": (1,)}))
    assert says in result.targets[0].error and result.targets[0].runs == []
    assert not result.targets[1].error and result.targets[1].runs[0].ok > 0


def test_an_unreachable_target_says_so():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = bench([Target.parse(f"http://127.0.0.1:{port}")], Workload(Lengths.parse("fixed:2")), Settings(**QUICK))
    assert result.targets[0].error.startswith(f"cannot reach http://127.0.0.1:{port}")


def test_a_repeat_with_another_draw_is_refused():
    with pytest.raises(ConfigError, match="sha256 differs"):
        bench([], Workload(Lengths.parse("fixed:2")), Settings(**QUICK), expect_sha256="0" * 64)


@pytest.mark.parametrize("changes, says", [
    (dict(clients=(0,)), "--clients must be 1..1024"), (dict(clients=(2000,)), "--clients"),
    (dict(rates=(0.0,)), "--rate must be more than 0"), (dict(rates=(1e6,)), "--rate"),
    (dict(duration_s=0.5), "--duration"), (dict(duration_s=601), "--duration"),
    (dict(max_requests=0), "--requests"), (dict(timeout_s=0), "--timeout"), (dict(warmup=1001), "--warmup"),
    (dict(max_in_flight=5000), "--max-in-flight"), (dict(sweep_p99_ms=0.5), "--sweep-p99"),
    (dict(sweep_steps=13), "--sweep-steps"), (dict(clients=(), rates=()), "nothing to run"),
    (dict(clients=(), rates=(2.0,), sweep_p99_ms=100), "needs a closed-loop run"),
    (dict(clients=tuple(range(1, 34))), "33 runs per target: at most 32"), (dict(api="grpc"), "--api is one of"),
    (dict(encoding="fp16"), "--encoding one of"), (dict(api="tei", encoding="base64"), "is OpenAI's API"),
])
def test_settings_are_bounded(changes, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        Settings(**({"clients": (1,)} | changes))


# -- the result files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sample() -> BenchResult:
    """One real bench of a stand-in server (closed, open and sweep runs), a failed target and a warning."""
    workload = Workload(Lengths.parse("fixed:3"), batch=2, distinct=4)
    with pytest.MonkeyPatch.context() as patch, BenchStub(delay_s=0.01) as stub:
        patch.setattr(hostload, "SAMPLE_S", 0.05)
        result = bench([Target.parse(f"fast={stub.endpoint}")], workload,
                       Settings(**QUICK, rates=(20.0,), sweep_p99_ms=300))
    failed = TargetResult(Target("gone", "http://127.0.0.1:1", "url"), error="cannot reach <script>x</script>")
    result.targets.append(failed)
    result.targets[0].warnings.append("the host was busy before this target ran")
    return result


def test_markdown_lists_every_run_the_sweep_failures_and_warnings(sample):
    result = sample
    text = output.markdown(result)
    rows = [line for line in text.splitlines() if line.startswith("| fast |")]
    assert len(rows) == 3 + len(result.targets[0].sweep.steps)  # 2 closed + 1 open + the sweep's steps
    assert "| fast | 1 clients |" in text and "| fast | 20 req/s offered |" in text
    assert "| gone | failed |" in text and "highest rate with p99 <= 300 ms" in text
    assert "- fast: the host was busy before this target ran" in text


def test_the_files_are_written_and_the_page_is_self_contained(sample, tmp_path):
    paths = output.write(sample, tmp_path / "out")
    assert [p.name for p in paths] == ["bench.json", "bench.md", "bench.png", "bench.html"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths[3].read_text()
    assert "<svg" in page and "<?xml" not in page and "<script" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
    assert not re.search(r"""(src|href)=["']?https?:""", page)
    data = json.loads(paths[0].read_text())
    assert data["mopt_bench"] == 1 and data["targets"][1]["error"].startswith("cannot reach")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (bash scripts/setup.sh installs it)")
def test_the_page_renders_in_headless_chromium(sample, tmp_path):
    page = output.html(sample)
    probe = """<script>
      const svg = document.querySelector('#chart svg');
      document.body.setAttribute('data-svg', svg ? Math.round(svg.getBoundingClientRect().width) : 0);
      document.body.setAttribute('data-lines', document.querySelectorAll('#chart svg path').length);
      document.body.setAttribute('data-rows', document.querySelectorAll('#runs tr[data-target]').length);
      document.body.setAttribute('data-red', getComputedStyle(document.querySelector('td.failed')).backgroundColor);
    </script>"""
    body = re.search(r"<body([^>]*)>", dump_dom(page, probe, tmp_path))
    assert body
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', body.group(1)))
    assert int(attrs["svg"]) > 300 and int(attrs["lines"]) > 10 and int(attrs["rows"]) >= 5
    assert attrs["red"] == "rgb(215, 58, 73)"


# -- the host's load --------------------------------------------------------------------------------

def test_host_load_is_sampled_from_proc_stat_and_a_busy_host_warned(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\n")

    def later():
        time.sleep(0.05)
        stat.write_text("cpu  400 0 200 1200 0 0 0 0 0 0\n")  # 400 busy of 800 jiffies

    thread = threading.Thread(target=later)
    thread.start()
    load = hostload.sample(0.3, stat)
    thread.join()
    assert load.busy == 0.5 and load.cpus >= 1
    assert "50% of" in hostload.warning("before", load)
    assert hostload.warning("after", hostload.HostLoad(2, 9.0, 0.1)) is None
    assert "load average was 1.5" in hostload.warning("before", hostload.HostLoad(2, 1.5, None))
    assert hostload.warning("before", hostload.HostLoad(2, 0.4, None)) is None
    assert hostload.sample(0.01, tmp_path / "absent").busy is None
    assert hostload.sample(0.01, stat).busy is None  # the same counts twice: no time passed for the CPUs
    late = tmp_path / "late"

    def appear():
        time.sleep(0.05)
        late.write_text("cpu  1 0 0 1\n")

    thread = threading.Thread(target=appear)
    thread.start()
    assert hostload.sample(0.3, late).busy is None  # unreadable before: no share
    thread.join()


# -- the command line --------------------------------------------------------------------------------

def test_mopt_bench_measures_writes_and_repeats(tmp_path):
    with BenchStub(delay_s=0.01) as a, BenchStub(mode="tei-only") as b:
        first = run_mopt("bench", f"a={a.endpoint}", f"b={b.endpoint}", "--lengths", "fixed:4", "--batch", "2",
                         "--clients", "2", "--duration", "1", "--warmup", "1", "--out", str(tmp_path / "one"),
                         env={"MOPT_BENCH_API_KEY": "cli-secret-77"})
        again = run_mopt("bench", f"a={a.endpoint}", "--workload", str(tmp_path / "one" / "bench.json"),
                         "--clients", "1", "--duration", "1", "--out", str(tmp_path / "two"))
        mixed = run_mopt("bench", f"a={a.endpoint}", "--workload", str(tmp_path / "one" / "bench.json"),
                         "--seed", "4", "--out", str(tmp_path / "three"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "| a | 2 clients |" in first.stdout and "| b | 2 clients |" in first.stdout
    one = json.loads((tmp_path / "one" / "bench.json").read_text())
    assert [t["api"] for t in one["targets"]] == ["openai", "tei"]
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "one").iterdir())
    everything = first.stdout + first.stderr + written
    assert "cli-secret-77" not in everything and a.auth[0] == "Bearer cli-secret-77"
    assert again.returncode == 0, again.stderr[-2000:]
    two = json.loads((tmp_path / "two" / "bench.json").read_text())
    assert two["workload"]["sha256"] == one["workload"]["sha256"]
    assert mixed.returncode == 2 and "does not go with --seed" in mixed.stderr


def test_mopt_bench_errors_are_one_line_with_their_exit_codes(tmp_path):
    with BenchStub(mode="garbage") as bad, BenchStub() as good:
        failed = run_mopt("bench", f"bad={bad.endpoint}", f"good={good.endpoint}", "--lengths", "fixed:2",
                          "--clients", "1", "--duration", "1", "--warmup", "0", "--out", str(tmp_path / "f"))
    assert failed.returncode == 10, failed.stderr[-2000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("mopt: error: 1 of 2 targets could not be measured: bad: POST")
    assert "Traceback" not in failed.stderr
    assert json.loads((tmp_path / "f" / "bench.json").read_text())["targets"][1]["runs"][0]["ok"] > 0
    for args, says in ((["http://example.org:80"], "not a loopback address"),
                       (["http://127.0.0.1:1", "--lengths", "fixed:0"], "1..8192 words"),
                       (["http://127.0.0.1:1", "--clients", "0"], "--clients must be"),
                       (["a=http://127.0.0.1:1", "a=http://127.0.0.1:2"], "two targets are named alike")):
        result = run_mopt("bench", *args, "--out", str(tmp_path / "x"))
        assert result.returncode == 2 and says in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "x").exists()  # refused before anything ran


# -- what a review found, as an attacker or a careless server would do it ----------------------------

def _one_target(stub, **settings) -> TargetResult:
    workload = Workload(Lengths.parse("fixed:2"), batch=1, distinct=2)
    return bench([Target.parse(f"t={stub.endpoint}")], workload, Settings(**({"clients": (1,), "duration_s": 1.0,
                                                                              "warmup": 0} | settings))).targets[0]


def test_a_redirect_never_takes_the_load_elsewhere():
    with BenchStub() as elsewhere, BenchStub(mode="redirect") as stub:
        stub.redirect_to = elsewhere.endpoint
        row = _one_target(stub)
        counted = asyncio.run(_load(stub).closed(1, 30, 3))
    assert row.error.startswith("POST ") and f"HTTP 307 to {elsewhere.endpoint}/v1/embeddings" in row.error
    assert counted.errors == {"http_307": 3} and elsewhere.seen == 0


def test_the_api_key_is_never_shown_even_when_the_server_echoes_it():
    with BenchStub(mode="echo") as stub:
        row = _one_target(stub, api_key="SEKRET123")
    assert "HTTP 401" in row.error and "Bearer ***" in row.error and "SEKRET123" not in json.dumps(row.to_json())


def test_server_text_is_one_printable_line():
    with BenchStub(mode="escapes") as stub:
        row = _one_target(stub)
    assert "HTTP 400: line1 line2 | x [2J [31mRED [0m ]0;title" in row.error
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in row.error)
    assert "\n" not in output.markdown(BenchResult({"lengths": "fixed:2", "words": {"min": 2, "median": 2, "max": 2},
                                                    "batch": 1, "seed": 0, "sha256": "0" * 64}, Settings(),
                                                   targets=[row])).split("| t | failed |")[1].split("|")[-2]


def test_every_vector_is_checked_not_only_the_first():
    with BenchStub(mode="strings") as stub:
        run = asyncio.run(_load(stub, texts=3).closed(1, 30, 2))
    assert run.errors == {"bad_response": 2}


def test_each_client_gets_its_own_connection_whatever_max_in_flight_says():
    with BenchStub(delay_s=0.3) as stub:
        run = asyncio.run(_load(stub, max_in_flight=2).closed(6, duration_s=30, max_requests=12))
    assert run.ok == 12 and stub.most_at_once == 6


def test_an_open_loop_ended_by_its_request_bound_reports_its_real_time():
    with BenchStub() as stub:
        run = asyncio.run(_load(stub).open(50, duration_s=10, max_requests=20, seed=3))
    assert run.sent == 20 and run.wall_s < 3 and run.requests_per_s > 10


def test_arrivals_follow_the_workload_seed():
    from builder.bench.run import arrival_seed

    with BenchStub() as stub:
        sent = {seed: asyncio.run(_load(stub).open(40, 0.5, 1000, arrival_seed(seed, 0))).sent for seed in (0, 9, 123)}
    assert len(set(sent.values())) > 1 and arrival_seed(0, 1) != arrival_seed(1, 0)


def test_tei_is_chosen_only_when_its_route_answers():
    with BenchStub(mode="status", status=404) as stub:  # 404 on both routes (vLLM's unknown model, say)
        row = _one_target(stub)
    assert row.api == "openai" and "POST " in row.error and "/v1/embeddings did not answer" in row.error


def test_a_failure_after_some_runs_is_on_the_page(sample):
    failed_late = TargetResult(Target("late", "http://127.0.0.1:1", "url"), runs=[sample.targets[0].runs[0]],
                               error="no closed-loop request was answered")
    page = output.html(BenchResult(sample.workload, sample.settings, targets=[failed_late]))
    assert "no closed-loop request was answered" in page and page.count('<tr data-target="late">') == 2


def test_a_dollar_in_a_name_is_text_in_the_chart(sample):
    named = TargetResult(Target("a$b$c", "http://127.0.0.1:1", "url"), runs=list(sample.targets[0].runs))
    assert output.chart(BenchResult(sample.workload, sample.settings, targets=[named]), "png")[:4] == b"\x89PNG"


def test_release_bench_reports_failed_requests_as_an_error():
    from builder.bench.run import RELEASE_SETTINGS, release_bench

    quick = replace(RELEASE_SETTINGS, duration_s=1.0, warmup=0)
    with BenchStub(mode="status") as stub, pytest.MonkeyPatch.context() as patch:
        patch.setattr("builder.bench.run.RELEASE_SETTINGS", quick)
        refused = release_bench(Target("v", stub.endpoint, "url"))
    assert refused == {"error": f"POST {stub.endpoint}/v1/embeddings did not answer as an embeddings server: "
                                "HTTP 503: {\"error\": {\"message\": \"busy\"}}"}
    with BenchStub() as stub, pytest.MonkeyPatch.context() as patch:
        stub.fail_after = 5  # the API probes and a few requests pass, then 503s
        patch.setattr("builder.bench.run.RELEASE_SETTINGS", quick)
        failing = release_bench(Target("v", stub.endpoint, "url"))
    assert re.fullmatch(r"\d+ of \d+ requests failed \(http_503 \d+\); \d+ answered", failing["error"]), failing
    with BenchStub() as stub, pytest.MonkeyPatch.context() as patch:
        patch.setattr("builder.bench.run.RELEASE_SETTINGS", quick)
        good = release_bench(Target("v", stub.endpoint, "url"))
    assert good["requests_per_s"] > 0 and good["errors"] == {} and "4 clients, 5 s" in good["workload"]


def _raw_server(answer: bytes, drip_s: float = 0.0):
    """A socket server that sends ANSWER (byte by byte every DRIP_S when set) to whoever connects."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    sock.settimeout(10)

    def serve():
        try:
            conn, _ = sock.accept()
            with conn:
                for i in range(len(answer)):
                    conn.sendall(answer[i:i + 1] if drip_s else answer[i:])
                    if not drip_s:
                        break
                    time.sleep(drip_s)
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("answer, drip_s", [(b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100, 0.2),
                                            (b"SSH-2.0-OpenSSH_9.6\r\n", 0.0)])
def test_readiness_probes_are_bounded_and_never_crash(answer, drip_s):
    from builder.bench.target import ready

    sock, url = _raw_server(answer, drip_s)
    started = time.monotonic()
    with sock:
        assert ready(url) is False
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("content, says", [
    ('{"workload": {"lengths": "fixed:3", "batch": 1, "max_words": 4, "distinct": 2, "seed": 0, "sha256": ""}}',
     "missing or not 64 hex"),
    ('{"workload": {"lengths": "fixed:3", "batch": Infinity, "max_words": 4, "distinct": 2, "seed": 0}}',
     "Infinity is not a number"),
    ('{"workload": {"lengths": "fixed:3", "batch": 1.5, "max_words": 4, "distinct": 2, "seed": 0, "sha256": "a"}}',
     "must be integers"),
    ("[" * 100_000 + "]" * 100_000, "cannot read it as JSON"),
])
def test_a_crafted_workload_file_is_one_line(tmp_path, content, says):
    path = tmp_path / "w.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(says)):
        Workload.from_json(path)


def test_special_files_and_huge_totals_are_refused(tmp_path):
    for spec in ("file:/dev/zero", f"file:{tmp_path}"):
        with pytest.raises(ConfigError, match="not a regular file|cannot read it"):
            Workload(Lengths.parse(spec)).requests()
    with pytest.raises(ConfigError, match="not a regular file"):
        Workload.from_json(Path("/dev/zero"))
    with pytest.raises(ConfigError, match=r"words to draw, more than 33,554,432"):
        Workload(Lengths.parse("fixed:8192"), batch=2048, max_words=8192)


@pytest.mark.parametrize("text", ["a\n=http://127.0.0.1:1", "img\n", "http://example.invalid:80"])
def test_trailing_newlines_and_unresolvable_names_are_refused(text):
    with pytest.raises(ConfigError):
        Target.parse(text)


@pytest.mark.parametrize("changes, says", [(dict(start_timeout_s=float("nan")), "--start-timeout"),
                                           (dict(start_timeout_s=float("inf")), "--start-timeout"),
                                           (dict(api_key="SEKRET\r"), "control or non-ASCII"),
                                           (dict(api_key=""), "is empty")])
def test_more_settings_are_bounded(changes, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        Settings(clients=(1,), **changes)


def test_too_many_targets_and_an_unwritable_out_stop_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="17 targets: at most 16"):
        bench([Target(f"t{i}", "http://127.0.0.1:1", "url") for i in range(17)], Workload(Lengths.parse("fixed:1")),
              Settings(clients=(1,)))
    (tmp_path / "file").write_text("")
    with BenchStub() as stub:
        result = run_mopt("bench", stub.endpoint, "--out", str(tmp_path / "file" / "sub"), "--duration", "1")
    assert result.returncode == 2 and "--out" in result.stderr and "cannot write there" in result.stderr
    assert stub.seen == 0


# -- exact records and edges (what the mutation check asks of this module) --------------------------

def test_a_run_record_is_exact():
    run = Run("closed", 4, 10, 8, {"timeout": 1, "http_503": 1}, 3.14159, 17, 331,
              latencies_ms=(10.004, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 81.126), client_cpu=0.123456)
    assert run.to_json() == {
        "mode": "closed", "level": 4, "sent": 10, "ok": 8, "errors": {"http_503": 1, "timeout": 1}, "wall_s": 3.142,
        "requests_per_s": 2.546, "texts_per_s": 5.41, "tokens": 331, "tokens_per_s": 105.4, "client_cpu": 0.123,
        "latency_ms": {"p50": 40.0, "p90": 81.13, "p99": 81.13, "max": 81.13}}
    assert list(run.to_json()["errors"]) == ["http_503", "timeout"]
    empty = Run("open", 2.5, 0, 0, {}, 0.0, 0, None).to_json()
    assert (empty["requests_per_s"], empty["texts_per_s"], empty["tokens_per_s"]) == (0.0, 0.0, None)


def test_a_sweep_record_is_exact():
    run = Run("open", 1, 5, 5, {}, 2.0, 10, 30, latencies_ms=(5.0,) * 5)
    record = Sweep(250.0, 21.353676, (Step(21.353676, False, run), Step(10.676838, True, run))).to_json()
    assert record == {"p99_target_ms": 250.0, "peak_rate": 21.354, "answer_rate": 10.677,
                      "steps": [{"rate": 21.354, "passed": False} | run.to_json(),
                                {"rate": 10.677, "passed": True} | run.to_json()]}


def test_the_sweep_stops_at_its_resolution_and_judges_by_p99_not_max():
    capacity, target = 50.0, 200.0
    result = sweep(lambda rate: _fake_run(rate, 20.0 * capacity / (capacity - min(rate, capacity - 0.01))),
                   peak_rate=48.0, p99_target_ms=target, steps=12)
    assert [s.rate for s in result.steps] == [48.0, 24.0, 36.0, 42.0, 45.0, 46.5, 45.75] and result.answer == 45.0
    assert len(sweep(lambda rate: _fake_run(rate, 1e6), 30.0, 100, steps=1).steps) == 1
    tail = Run("open", 5, 100, 100, {}, 10.0, 100, None, latencies_ms=(10.0,) * 99 + (900.0,))
    assert passes(tail, 100) and passes(Run("open", 1, 1, 1, {}, 1.0, 1, None, latencies_ms=(9.0,)), 10)


def test_a_target_name_is_what_comes_before_the_first_equals_sign():
    assert Target.parse("n=http://127.0.0.1:1/a=b") == Target("n", "http://127.0.0.1:1/a=b", "url")
    assert Target.parse("127.0.0.1:5000/mopt/minilm-embed:cpu").name == "minilm-embed:cpu"
    assert Target.parse("a/b/c/d").name == "d" and Target.parse("http://127.0.0.1:8000/prefiX/").ref == \
        "http://127.0.0.1:8000/prefiX"
    for text in ("a:b=c", "a/b=c"):
        with pytest.raises(ConfigError, match=re.escape(f"target {text!r}: neither an http(s):// URL nor an image")):
            Target.parse(text)


@pytest.mark.parametrize("url, says", [
    ("ftp://127.0.0.1/", "target URL 'ftp://127.0.0.1/': use http://HOST[:PORT][/PREFIX] or https://..."),
    ("http://user@127.0.0.1/", "target URL 'http://user@127.0.0.1/': no credentials in the URL"),
    ("http://127.0.0.1/?a", "target URL 'http://127.0.0.1/?a': a base URL has no query or fragment"),
    ("http://10.1.2.3/", "target URL 'http://10.1.2.3/': 10.1.2.3 is not a loopback address"),
    ("http://127.0.0.1:x/", "target URL 'http://127.0.0.1:x/': Port could not be cast to integer value as 'x'"),
])
def test_url_refusals_quote_the_url(url, says):
    with pytest.raises(ConfigError) as caught:
        Target.parse(url)
    assert caught.value.message.startswith(says), caught.value.message


def test_a_name_is_loopback_only_when_every_address_is(monkeypatch):
    from builder.bench import target

    answers = {"only-lo": ["127.0.0.1", "::1"], "mixed": ["127.0.0.1", "192.0.2.1"], "far": ["192.0.2.1"],
               "none": []}
    monkeypatch.setattr(target.socket, "getaddrinfo",
                        lambda host, port: [(0, 0, 0, "", (a, 0)) for a in answers[host]])
    assert [target._loopback(h) for h in ("only-lo", "mixed", "far", "none")] == [True, False, False, False]
    assert target._loopback("::1") and not target._loopback("192.0.2.7")


def test_workload_messages_and_edges(tmp_path):
    long = "fixed:" + "9" * 100
    with pytest.raises(ConfigError) as caught:
        Lengths.parse(long)
    assert caught.value.message == (f"--lengths {long[:80] + '...'!r}: a length must be 1..8192 words; "
                                    "use fixed:N, lognormal:MEDIAN[:SIGMA] or file:PATH")
    for text in ("gauss" + "x" * 100, "file:"):
        shown = (text[:80] + "...") if len(text) > 80 else text
        with pytest.raises(ConfigError, match=re.escape(f"--lengths {shown!r}")):
            Lengths.parse(text)
    assert Lengths.parse("lognormal:10:3").sigma == 3.0 and str(Lengths.parse("lognormal:7")) == "lognormal:7:0.8"
    for name, field in (("--batch", "batch"), ("--max-words", "max_words"), ("distinct requests", "distinct")):
        with pytest.raises(ConfigError, match=re.escape(f"{name} must be 1..")):
            Workload(Lengths.parse("fixed:1"), **{field: 0})
    Workload(Lengths.parse("fixed:1"), seed=2**63 - 1)
    with pytest.raises(ConfigError, match="--seed must be"):
        Workload(Lengths.parse("fixed:1"), seed=2**63)
    Workload(Lengths.parse("fixed:1"), distinct=4096, batch=1, max_words=8192)  # exactly 2**25 words: allowed
    with pytest.raises(ConfigError, match="4,096 requests|4096 requests"):
        Workload(Lengths.parse("fixed:1"), distinct=4096, batch=2, max_words=4097)
    one = Workload(Lengths.parse("fixed:1"), batch=2, distinct=3).requests()
    assert all(len(t.split()) == 1 for b in one for t in b)
    from builder.bench.workload import WORDS

    drawn = Workload(Lengths.parse("lognormal:9"), batch=4, distinct=8).requests()
    assert all(word in WORDS for b in drawn for t in b for word in t.split(" "))
    data = Workload(Lengths.parse("lognormal:9"), batch=4, distinct=8).to_json(drawn)
    words = sorted(len(t.split()) for b in drawn for t in b)
    assert data["words"] == {"min": words[0], "median": words[16], "max": words[-1],
                             "mean": round(sum(words) / 32, 1)} and words[0] != words[16] != words[-1]
    assert digest([["é"]]) == hashlib.sha256('[["é"]]'.encode()).hexdigest()


def test_workload_file_messages_and_limits(tmp_path, monkeypatch):
    from builder.bench import workload

    missing = tmp_path / "missing.txt"
    with pytest.raises(ConfigError) as caught:
        Workload(Lengths.parse(f"file:{missing}")).requests()
    assert caught.value.message == f"--lengths file:{missing}: cannot read it: No such file or directory"
    exact = tmp_path / "exact.txt"
    exact.write_text("a" * 63 + "\n")
    monkeypatch.setattr(workload, "MAX_FILE_BYTES", 64)
    assert Workload(Lengths.parse(f"file:{exact}"), distinct=1, batch=1).requests() == [["a" * 63]]
    exact.write_text("a" * 64 + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"--lengths file:{exact}: more than 64 bytes")):
        Workload(Lengths.parse(f"file:{exact}")).requests()
    texts = tmp_path / "texts.txt"
    texts.write_text("one two\n")
    spec = Workload(Lengths.parse(f"file:{texts}"), distinct=1, batch=1)
    drawn = spec.requests()
    texts.unlink()
    with pytest.raises(ConfigError, match=re.escape(f"--lengths file:{texts}: cannot read it")):
        spec.to_json(drawn)
    wl = tmp_path / "w.json"
    with pytest.raises(ConfigError) as caught:
        Workload.from_json(tmp_path)
    assert caught.value.message.startswith(f"--workload {tmp_path}: ")
    wl.write_text(json.dumps({"lengths": "fixed:1", "batch": "x" * 300, "max_words": 1, "distinct": 1, "seed": 0,
                              "sha256": "0" * 64}))
    with pytest.raises(ConfigError) as caught:
        Workload.from_json(wl)
    message = caught.value.message
    assert message.startswith(f"--workload {wl}: not a mopt bench result or workload: batch, max_words")
    assert message.endswith("...") and len(message.split("workload: ", 1)[1]) == 163
    wl.write_text(json.dumps({"lengths": "fixed:1", "batch": 1, "max_words": 1, "distinct": 1, "seed": 0,
                              "sha256": "z"}))
    with pytest.raises(ConfigError) as caught:
        Workload.from_json(wl)
    assert caught.value.message.endswith(": its sha256 of the drawn texts is missing or not 64 hex digits")
    wl.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=re.escape(f"--workload {wl}: cannot read it as JSON: ")):
        Workload.from_json(wl)


def test_printable_is_one_clipped_line():
    from builder.bench.api import printable

    assert printable(b"\xff ok\x1b[2J\nnext") == "\ufffd ok [2J next"
    assert printable("x" * 300) == "x" * 200 + "..." and printable("y" * 300, 10) == "y" * 10 + "..."


@pytest.mark.parametrize("line, busy_total", [
    ("cpu  100 5 50 800 40 3 2 1 7 9", (161, 1001)),  # guest and guest_nice are in user and nice already
    ("cpu  100 0 100 800", (200, 1000)), ("cpu  100 0 100 800 40", (200, 1040)),
    ("cpu  x 0 0 0", None), ("", None),
])
def test_cpu_times_read_from_proc_stat(tmp_path, line, busy_total):
    stat_file = tmp_path / "stat"
    stat_file.write_text(line + "\n" if line else "")
    assert hostload._cpu_times(stat_file) == busy_total


def test_host_samples_and_warnings_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(hostload.os, "getloadavg", lambda: (1.23456, 2.0, 3.0))
    monkeypatch.setattr(hostload.os, "cpu_count", lambda: None)
    stat_file = tmp_path / "stat"
    stat_file.write_text("cpu  0 0 0 0\n")

    def later():
        time.sleep(0.05)
        stat_file.write_text("cpu  100 0 0 200\n")

    thread = threading.Thread(target=later)
    thread.start()
    load = hostload.sample(0.3, stat_file)
    thread.join()
    assert load == hostload.HostLoad(cpus=1, load1=1.23, busy=0.333)
    assert hostload.warning("before", hostload.HostLoad(2, 0.0, 0.25)) is None
    assert hostload.warning("before", hostload.HostLoad(2, 0.5, None)) is None
    assert hostload.warning("before", hostload.HostLoad(2, 0.51, None)) is not None


def test_percentiles_of_a_thousand():
    run = Run("closed", 1, 1000, 1000, {}, 1.0, 1000, None, latencies_ms=tuple(float(i) for i in range(1, 1001)))
    assert [run.percentile(q) for q in (50, 90, 99, 100)] == [500.0, 900.0, 990.0, 1000.0]
