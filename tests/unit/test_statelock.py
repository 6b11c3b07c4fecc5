"""One mopt process at a time per state dir (statelock.py), with real processes: a second one waits,
saying who holds the lock, then goes on when it is released, or gives up after MOPT_LOCK_WAIT with
one message; the host's list of state dirs that prune keeps."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.errors import EnvironmentProblem
from builder.statelock import holder, known_state_dirs, register, state_lock
from tests.conftest import REPO, run_mopt

HOLD = """
import sys, time
sys.path.insert(0, {repo!r})
from builder.statelock import state_lock
with state_lock({root!r}, "test holder", log=lambda m: None, wait_s=0):
    print("held", flush=True)
    time.sleep({seconds})
"""


def hold(root: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=str(REPO), root=str(root), seconds=seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_state_dir_is_refused_with_who_holds_it(tmp_path):
    proc = hold(tmp_path, 30)
    try:
        found = holder(tmp_path)
        assert found is not None and found.pid == proc.pid and found.command == "test holder"
        with pytest.raises(EnvironmentProblem, match=rf"in use by pid {proc.pid} \(test holder, since"):
            with state_lock(tmp_path, "second", log=lambda m: None, wait_s=0):
                pass
    finally:
        proc.kill()
        proc.wait()
    assert holder(tmp_path) is None  # the kernel released the dead holder's lock
    with state_lock(tmp_path, "third", log=lambda m: None, wait_s=0):
        assert holder(tmp_path).command == "third"


def test_a_second_mopt_waits_for_the_first_then_runs(workdir):
    state = workdir / "state"
    proc = hold(state, 3)
    start = time.monotonic()
    res = run_mopt("test", "--matrix", str(workdir / "matrix.yaml"), "--select", "no-such-image:x",
                   "--state-dir", str(state), env={"MOPT_LOCK_WAIT": "60"})
    proc.wait()
    assert time.monotonic() - start >= 2.5  # it waited for the holder
    assert f"waiting for state dir {state}: in use by pid {proc.pid} (test holder" in res.stdout + res.stderr
    assert res.returncode == 2 and "no-such-image:x" in res.stderr  # then ran: the select matched nothing


def test_mopt_gives_up_after_the_wait_with_one_message(workdir):
    state = workdir / "state"
    proc = hold(state, 30)
    try:
        res = run_mopt("build", "--matrix", str(workdir / "matrix.yaml"), "--select", "minilm-embed:cpu",
                       "--state-dir", str(state), env={"MOPT_LOCK_WAIT": "0"})
    finally:
        proc.kill()
        proc.wait()
    assert res.returncode == 7, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"state dir {state} is in use by pid {proc.pid}" in lines[0]
    bad = run_mopt("build", "--matrix", str(workdir / "matrix.yaml"), "--state-dir", str(state),
                   env={"MOPT_LOCK_WAIT": "soon"})
    assert bad.returncode == 7 and "MOPT_LOCK_WAIT='soon'" in bad.stderr


def test_state_dirs_are_listed_once_and_only_while_they_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("MOPT_STATE_REGISTRY", str(tmp_path / "registry"))
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "variants").mkdir(parents=True)
        register(d)
        register(d)
    assert known_state_dirs() == [a.resolve(), b.resolve()]
    assert (tmp_path / "registry").read_text().splitlines() == [str(a.resolve()), str(b.resolve())]
    os.rename(b, tmp_path / "gone")
    assert known_state_dirs() == [a.resolve()]
