"""The CLI contract: exit codes, JSON shapes, one-line errors without tracebacks."""
import json

from tests.conftest import run_mopt


def test_plan_json_shape():
    result = run_mopt("plan", "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= {"variants", "rejected"}
    v = next(v for v in data["variants"] if v["id"] == "qwen3-embed:cu121-sm86")
    assert v["image"] == "qwen3-embed" and v["tag"] == "cu121-sm86"
    assert v["tags"][0] == "cu121-sm86" and len(v["tags"]) == 2
    assert v["axes"] == {"cuda": "12.1", "sm": "86", "tensorrt": v["resolved"]["tensorrt"],
                         "torch": v["resolved"]["torch"], "python": "3.10", "base": "nvidia-cuda"}
    r = data["rejected"][0]
    assert set(r) >= {"image", "axes", "reasons"} and r["reasons"]


def test_plan_table_and_select():
    result = run_mopt("plan", "--select", "minilm-embed:*")
    assert result.returncode == 0
    assert "minilm-embed:cpu" in result.stdout and "qwen3-embed" not in result.stdout


def test_select_matching_nothing_exits_2():
    result = run_mopt("plan", "--select", "nope:*")
    assert result.returncode == 2
    assert "matches no variant" in result.stderr and "Traceback" not in result.stderr


def test_compat_compatible_json():
    result = run_mopt("compat", "--cuda", "12.8", "--sm", "sm_100", "--vllm", "0.10.0", "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["compatible"] is True and data["reasons"] == []
    assert data["resolved"]["torch"] == "2.7.1" and data["resolved"]["min_driver"] == "570.26"


def test_compat_incompatible_exit_3_prints_each_reason():
    result = run_mopt("compat", "--cuda", "12.4", "--sm", "10.0", "--driver", "535")
    assert result.returncode == 3
    assert "12.8" in result.stdout  # sm_100 added in 12.8
    assert "550.54.14" in result.stdout  # 12.4 needs driver >= 550.54.14
    assert "Traceback" not in result.stderr


def test_compat_sm_forms_agree():
    outs = [json.loads(run_mopt("compat", "--cuda", "13.0", "--sm", form, "--format", "json").stdout)
            for form in ("70", "7.0", "sm_70")]
    assert all(o == outs[0] for o in outs) and outs[0]["compatible"] is False


def test_compat_bad_input_exit_2():
    for args in (["--cuda", "12.1", "--sm", "eighty-six"], ["--cuda", "twelve"], []):
        result = run_mopt("compat", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr and result.stderr.strip()


def test_render_writes_directories(tmp_path):
    result = run_mopt("render", "--select", "*:cpu", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("Dockerfile.base", "Dockerfile.runtime", "compile.sh", "Dockerfile.final", "manifest.json"):
        assert (tmp_path / "minilm-embed" / "cpu" / name).is_file()
    manifest = json.loads((tmp_path / "qwen3-embed" / "cpu" / "manifest.json").read_text())
    assert manifest["id"] == "qwen3-embed:cpu" and [s["name"] for s in manifest["stages"]] == [
        "base", "runtime", "toolchain", "compile", "final"]


def test_matrix_github():
    result = run_mopt("matrix", "--github")
    assert result.returncode == 0
    include = json.loads(result.stdout)["include"]
    gpu = next(i for i in include if i["id"] == "qwen3-embed:cu121-sm86")
    assert gpu["runner"] == ["self-hosted", "linux", "x64", "gpu-sm86"] and gpu["tag"] == "cu121-sm86"
    cpu = next(i for i in include if i["id"] == "minilm-embed:cpu")
    assert cpu["runner"] == ["ubuntu-24.04"]


def test_missing_matrix_file_exit_2(tmp_path):
    result = run_mopt("plan", "--matrix", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "nope.yaml: file not found" in result.stderr


def test_unknown_option_exit_2():
    result = run_mopt("plan", "--frobnicate")
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_release_locked_needs_the_lock_file(workdir):
    """`mopt release --locked` pins like `build --locked`: without mopt.lock.json it refuses, exit 2."""
    res = run_mopt("release", "--locked", "--select", "minilm-embed:cpu", "--matrix", str(workdir / "matrix.yaml"),
                   "--state-dir", str(workdir / "state"))
    assert res.returncode == 2
    assert f"--locked but {workdir / 'mopt.lock.json'} does not exist (run mopt lock first)" in res.stderr


def test_plan_markdown_is_a_full_table_for_a_job_summary():
    res = run_mopt("plan", "--format", "markdown", "--select", "minilm-embed:*")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = "| id | backend | cuda | sm | version | torch | min driver | model |"
    assert lines[0].startswith("### 2 variants from ") and header in lines
    rows = [ln for ln in lines if ln.startswith("| minilm-embed:")]
    assert [r.split(" | ")[0] for r in rows] == ["| minilm-embed:cpu", "| minilm-embed:cpu-vllm"]
    assert all(r.count(" | ") == 7 for r in rows)  # every column, uncut
    assert not any(ch in res.stdout for ch in "│┃━─")  # no box drawing


def test_errors_quote_input_as_given_and_bounded(tmp_path):
    # rich's :emoji: codes are not rendered: a message quotes the input as typed
    result = run_mopt("compat", "--python", ":x: :smile:")
    assert result.returncode == 2 and "':x: :smile:'" in result.stderr
    # a long value or a whole file in an error is cut, with the count of what was left out
    big = tmp_path / "kb.yaml"
    big.write_text("- " + "x" * 20000 + "\n")
    result = run_mopt("kb", "check", "--kb", str(big))
    assert result.returncode == 2 and len(result.stderr) < 800 and "..." in result.stderr
    result = run_mopt("compat", "--cuda", "12.8", "--driver", "5" * 5000)
    assert result.returncode == 2 and len(result.stderr) < 300 and "Traceback" not in result.stderr


def test_a_message_over_the_cap_says_how_much_is_not_shown():
    from builder.cli import MAX_ERROR_CHARS, _capped

    assert _capped("a" * MAX_ERROR_CHARS) == "a" * MAX_ERROR_CHARS
    assert _capped("a" * (MAX_ERROR_CHARS + 7)) == "a" * MAX_ERROR_CHARS + "... (7 more characters not shown)"


def test_a_bad_registry_is_refused_when_parsed_before_any_build():
    """--registry and --cache-registry fail with exit 2 and one line before the state dir is even locked:
    a malformed value is never found only after the whole build and test."""
    for args in (("release", "--registry", "http://127.0.0.1:5000"), ("publish", "--registry", "a b"),
                 ("promote", "--registry", "user@host", "--records", "records"),
                 ("build", "--cache-registry", ""), ("release", "--cache-registry", "[::1")):
        result = run_mopt(*args, "--select", "minilm-embed:cpu", "--state-dir", "/nonexistent/never-made")
        assert result.returncode == 2, (args, result.stderr)
        assert f"Invalid value for '{args[1]}'" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert "variants to" not in result.stdout + result.stderr  # nothing started
