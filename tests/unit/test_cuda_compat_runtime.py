"""CUDA forward compatibility at start (builder/runtime/cudacompat.py): the decision, and a real re-exec
in a child process with the compat directory first on LD_LIBRARY_PATH, exactly once."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from builder.runtime import cudacompat
from builder.runtime.cudacompat import Decision, decide

REPO = Path(__file__).resolve().parent.parent.parent
NVRM_535 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
NVRM_580 = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


@pytest.fixture
def compat(tmp_path) -> Path:
    d = tmp_path / "cuda-12.8" / "compat"
    d.mkdir(parents=True)
    (d / "libcuda.so.1").write_bytes(b"")
    return d


def _env(compat_dir, minimum="570.26", **extra) -> dict[str, str]:
    return {"MOPT_CUDA_COMPAT_DIR": str(compat_dir), "MOPT_CUDA_MIN_DRIVER": minimum, **extra}


@pytest.mark.parametrize("driver", ["535.104.05", "570.25.99", "570", "1.0"])
def test_an_older_driver_uses_the_compat_libraries(compat, driver):
    d = decide(_env(compat), driver)
    assert d.action == "use-compat" and d.ld_library_path == str(compat)
    assert driver in d.reason and "570.26" in d.reason and str(compat) in d.reason


@pytest.mark.parametrize("driver", ["570.26", "570.26.0", "570.26.1", "570.133.20", "580.1", "1000.0"])
def test_a_driver_new_enough_leaves_everything_alone(compat, driver):
    d = decide(_env(compat, LD_LIBRARY_PATH="/opt/x"), driver)
    assert d == Decision("none", d.reason, None)
    assert "new enough" in d.reason


def test_versions_compare_numerically_not_as_text(compat):
    assert decide(_env(compat, minimum="570.9"), "570.10").action == "none"  # text would say "570.10" < "570.9"
    assert decide(_env(compat, minimum="570.10"), "570.9").action == "use-compat"
    assert decide(_env(compat, minimum="99.0"), "100.0").action == "none"


def test_without_compat_libraries_nothing_changes_and_the_reason_says_so(tmp_path, compat):
    missing = decide(_env(tmp_path / "absent"), "535.104.05")
    assert missing.action == "none" and missing.ld_library_path is None
    assert "no compat libraries" in missing.reason
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "libcudart.so.12").write_bytes(b"")  # not the driver library
    no_libcuda = decide(_env(empty), "535.104.05")
    assert no_libcuda.action == "none" and "no compat libraries" in no_libcuda.reason
    a_file = decide(_env(compat / "libcuda.so.1"), "535.104.05")  # not a directory
    assert a_file.action == "none"


@pytest.mark.parametrize("driver", [None, ""])
def test_no_driver_no_compat(compat, driver):
    d = decide(_env(compat), driver)
    assert d.action == "none" and d.ld_library_path is None and "no NVIDIA driver" in d.reason


@pytest.mark.parametrize("driver, minimum", [("535.x", "570.26"), ("v535", "570.26"), ("535..1", "570.26"),
                                             ("535.104.05", "570.26-1"), ("535.104.05", "latest"),
                                             ("535.104.05", ".570")])
def test_malformed_versions_are_no_compat_with_a_reason_never_an_exception(compat, driver, minimum):
    d = decide(_env(compat, minimum=minimum), driver)
    assert d.action == "none" and d.ld_library_path is None and "not a dotted version" in d.reason


@pytest.mark.parametrize("environ", [{}, {"LD_LIBRARY_PATH": "/opt/x"},
                                     {"MOPT_CUDA_COMPAT_DIR": "/usr/local/cuda-12.8/compat"},
                                     {"MOPT_CUDA_MIN_DRIVER": "570.26"},
                                     {"MOPT_CUDA_COMPAT_DIR": "", "MOPT_CUDA_MIN_DRIVER": "570.26"}])
def test_a_cpu_image_without_the_variables_does_nothing(environ):
    d = decide(environ, "535.104.05")
    assert d.action == "none" and d.ld_library_path is None and "not set" in d.reason


@pytest.mark.parametrize("current, expected", [
    (None, "{c}"),
    ("", "{c}"),
    ("/opt/x", "{c}:/opt/x"),
    ("/opt/x:/opt/y", "{c}:/opt/x:/opt/y"),
    ("{c}", "{c}"),  # already first: not duplicated
    ("{c}/", "{c}/"),
    ("{c}:/opt/x", "{c}:/opt/x"),
    ("/opt/x:{c}", "{c}:/opt/x:{c}"),  # later on the path it does not come first: prepend
])
def test_ld_library_path_gets_the_compat_dir_first_once(compat, current, expected):
    env = _env(compat)
    if current is not None:
        env["LD_LIBRARY_PATH"] = current.format(c=compat)
    d = decide(env, "535.104.05")
    assert d.ld_library_path == expected.format(c=compat)
    assert not d.ld_library_path.endswith(":")  # an empty entry would be the working directory


def test_the_driver_version_comes_from_the_kernel_module_file(tmp_path, monkeypatch):
    path = tmp_path / "version"
    path.write_text(NVRM_535)
    monkeypatch.setattr(cudacompat, "PROC_DRIVER_VERSION", path)
    assert cudacompat.driver_version() == "535.104.05"
    path.write_text(NVRM_580)
    assert cudacompat.driver_version() == "580.159.04"
    path.write_text("garbage\n")
    assert cudacompat.driver_version() is None
    monkeypatch.setattr(cudacompat, "PROC_DRIVER_VERSION", tmp_path / "absent")
    assert cudacompat.driver_version() is None


# The child: patch the driver source, call reexec_if_needed() (which re-executes this very script, by
# sys.orig_argv), then report. RUNS counts the runs, so a re-exec without the marker's stop shows.
CHILD = textwrap.dedent("""\
    import os, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from builder.runtime import cudacompat
    runs = Path(os.environ["RUNS"])
    runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
    if len(runs.read_text()) > 3:
        sys.exit(99)  # a loop: the marker was ignored
    cudacompat.PROC_DRIVER_VERSION = Path(os.environ["FAKE_PROC_VERSION"])
    cudacompat.reexec_if_needed()
    print("LD=" + repr(os.environ.get("LD_LIBRARY_PATH")))
    print("APPLIED=" + repr(os.environ.get("MOPT_CUDA_COMPAT_APPLIED")))
    print("ARGS=" + repr(sys.argv[1:]))
    """)


def _run_child(tmp_path, nvrm: str, compat_dir, ld: str | None):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    proc_version = tmp_path / "proc-version"
    proc_version.write_text(nvrm)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "MOPT_CUDA_COMPAT_APPLIED")}
    env.update(_env(compat_dir), FAKE_PROC_VERSION=str(proc_version), RUNS=str(tmp_path / "runs"))
    if ld is not None:
        env["LD_LIBRARY_PATH"] = ld
    proc = subprocess.run([sys.executable, "-u", str(script), "serve", "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=60)
    out = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    runs = len((tmp_path / "runs").read_text())
    return proc, out, runs


def test_an_old_driver_re_executes_once_with_the_compat_libraries_first(tmp_path, compat):
    proc, out, runs = _run_child(tmp_path, NVRM_535, compat, "/opt/x")
    assert proc.returncode == 0, proc.stderr
    assert runs == 2  # the first run, then the re-executed one, which did not re-execute again
    assert out["LD"] == repr(f"{compat}:/opt/x")
    assert out["APPLIED"] == repr("1")
    assert out["ARGS"] == repr(["serve", "--port", "1"])  # the same command line
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("mopt: driver 535.104.05 is older than CUDA's minimum 570.26")
    assert str(compat) in lines[0]


def test_a_new_enough_driver_neither_re_executes_nor_says_anything(tmp_path, compat):
    proc, out, runs = _run_child(tmp_path, NVRM_580, compat, "/opt/x")
    assert proc.returncode == 0, proc.stderr
    assert runs == 1
    assert out["LD"] == repr("/opt/x") and out["APPLIED"] == repr(None)
    assert proc.stderr == ""


def test_an_old_driver_without_compat_libraries_runs_on_unchanged(tmp_path):
    proc, out, runs = _run_child(tmp_path, NVRM_535, tmp_path / "absent", None)
    assert proc.returncode == 0, proc.stderr
    assert runs == 1 and out["LD"] == repr(None) and out["APPLIED"] == repr(None) and proc.stderr == ""


def test_the_cli_re_executes_serve_and_check_before_loading_a_backend(tmp_path, compat):
    # `python -m builder.runtime check` with an old driver: the re-executed process (marker set) then
    # runs the guard, which fails on the missing engine dir; the compat line comes first, once.
    script = tmp_path / "cli.py"
    script.write_text(textwrap.dedent(f"""\
        import os, runpy, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from builder.runtime import cudacompat
        cudacompat.PROC_DRIVER_VERSION = Path(os.environ["FAKE_PROC_VERSION"])
        if os.environ.get("MOPT_CUDA_COMPAT_APPLIED"):
            print("APPLIED LD=" + os.environ["LD_LIBRARY_PATH"], file=sys.stderr)
        execve = os.execve
        def spy(*args):
            print(f"torch loaded at the re-exec: {{'torch' in sys.modules}}", file=sys.stderr, flush=True)
            execve(*args)
        os.execve = spy
        sys.argv[0] = "builder.runtime"
        runpy.run_module("builder.runtime", run_name="__main__", alter_sys=True)
        """))
    proc_version = tmp_path / "proc-version"
    proc_version.write_text(NVRM_535)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "MOPT_CUDA_COMPAT_APPLIED",
                                                             "MOPT_ENGINE_DIR")}
    env.update(_env(compat), FAKE_PROC_VERSION=str(proc_version))
    proc = subprocess.run([sys.executable, str(script), "check", "--engine-dir", str(tmp_path / "none")],
                          env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("mopt: driver 535.104.05 is older"), proc.stderr
    assert lines[1] == "torch loaded at the re-exec: False", proc.stderr
    assert lines[2] == f"APPLIED LD={compat}", proc.stderr
    assert sum(line.startswith("mopt: driver") for line in lines) == 1
    assert proc.returncode != 0 and "error:" in proc.stderr  # then the guard ran, in the re-executed process
