"""Bad configuration never reaches Docker: `mopt build --select ...` runs in-process on fuzzed matrices
and recipes with every way into the docker CLI patched to fail the test; a broken config must exit 2
(ConfigError, one line) before any docker command. Plus the disk-space check before builds.
"""
from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder import build as build_mod
from builder import cli, dockerclient
from builder.errors import ConfigError, EnvironmentProblem
from builder.matrix import load_matrix
from builder.plan import make_plan
from tests.unit.test_config_fuzz import (
    MATRIX_OPEN,
    MATRIX_PATHS,
    RECIPE,
    RECIPE_PATHS,
    SHIPPED,
    added_unknown_key,
    mutate,
    unknown_key_text,
    values,
)

REPO = Path(__file__).resolve().parent.parent.parent


def setup_tree(tmp: Path, matrix_text: str, recipe_text: str | None = None) -> None:
    """Every shipped recipe (a matrix may name any of them), the qwen3-embed one possibly fuzzed."""
    shutil.copytree(REPO / "images", tmp / "images", dirs_exist_ok=True)
    if recipe_text is not None:
        (tmp / "images/qwen3-embed/image.yaml").write_text(recipe_text)
    (tmp / "matrix.yaml").write_text(matrix_text)


class DockerTouched(BaseException):  # not an Exception: nothing in mopt may swallow it
    pass


def _touched(*args, **kwargs):
    raise DockerTouched(args[:1])


@pytest.fixture(scope="module")
def no_docker():
    mp = pytest.MonkeyPatch()
    for module, name in ((dockerclient, "run_docker"), (dockerclient, "find_docker"), (dockerclient, "_quick"),
                         (build_mod, "run_docker"), (build_mod, "find_docker")):
        mp.setattr(module, name, _touched)
    yield
    mp.undo()


def _build_in_process(tmp: Path, select: str) -> tuple[str, int | None]:
    """('exit', code) or ('docker', None) when the build reached docker."""
    (tmp / "templates").exists() or (tmp / "templates").symlink_to(REPO / "templates")
    try:
        cli.main(["build", "--matrix", str(tmp / "matrix.yaml"), "--select", select, "--state-dir",
                  str(tmp / "state"), "--ca-bundle", "none"])
    except SystemExit as exc:
        return "exit", exc.code
    except DockerTouched:
        return "docker", None
    raise AssertionError("mopt exited without SystemExit")


def _valid(tmp: Path) -> bool:
    try:
        make_plan(load_matrix(tmp / "matrix.yaml"))
        return True
    except ConfigError:
        return False


def _check(tmp: Path, select: str, capsys, added: tuple | None = None) -> None:
    """`added`: the key path of a key the schema does not allow, which must stop the build (exit 2)."""
    outcome, code = _build_in_process(tmp, select)
    err = capsys.readouterr().err
    if outcome == "docker":  # only a config that loads and plans may ever reach docker
        assert added is None, f"{added} was added and the build reached docker"
        assert _valid(tmp), "an invalid matrix reached a docker command"
        return
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err
    if code == 2:
        assert err.strip() and "mopt: error" in err
    if added is not None:
        assert code == 2 and unknown_key_text(added) in err, (code, err)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(MATRIX_PATHS), action=st.sampled_from(["replace", "delete", "add"]), value=values,
       select=st.sampled_from(["*", "*:cpu", "minilm-embed:*", "qwen3-embed:cu12*"]))
def test_fuzzed_matrix_never_reaches_docker(no_docker, tmp_path_factory, capsys, path, action, value, select):
    tmp = tmp_path_factory.mktemp("bm")
    setup_tree(tmp, yaml.safe_dump(mutate(SHIPPED, path, action, value), sort_keys=False))
    _check(tmp, select, capsys, added_unknown_key(SHIPPED, path, action, MATRIX_OPEN))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(RECIPE_PATHS), action=st.sampled_from(["replace", "delete", "add"]), value=values)
def test_fuzzed_recipe_never_reaches_docker(no_docker, tmp_path_factory, capsys, path, action, value):
    tmp = tmp_path_factory.mktemp("br")
    setup_tree(tmp, (REPO / "matrix.yaml").read_text(), yaml.safe_dump(mutate(RECIPE, path, action, value)))
    _check(tmp, "qwen3-embed:*", capsys, added_unknown_key(RECIPE, path, action))


def test_broken_matrix_and_bad_select_exit_2_without_docker(no_docker, tmp_path, capsys):
    setup_tree(tmp_path, "version: 1\nimages: [\n")
    assert _build_in_process(tmp_path, "*") == ("exit", 2)
    setup_tree(tmp_path, (REPO / "matrix.yaml").read_text())
    assert _build_in_process(tmp_path, "no-such-image:*") == ("exit", 2)
    assert "no-such-image" in capsys.readouterr().err


# --------------------------------------------------------------------------- disk space
Usage = namedtuple("Usage", "total used free")


def _builder(tmp_path: Path, min_free_gib: float = 4.0) -> build_mod.Builder:
    b = build_mod.Builder.__new__(build_mod.Builder)
    b.options = build_mod.BuildOptions(state_dir=tmp_path, templates=tmp_path, min_free_gib=min_free_gib)
    b.state = b.options.state
    return b


def test_disk_check_refuses_a_nearly_full_disk(monkeypatch, tmp_path):
    seen = []

    def usage(path):
        seen.append(Path(path))
        return Usage(100 * 2**30, 99 * 2**30, int(1.5 * 2**30))

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with pytest.raises(EnvironmentProblem) as exc:
        _builder(tmp_path)._check_disk()
    assert exc.value.exit_code == 7
    assert "1.5 GiB free" in exc.value.message and "at least 4.0 GiB" in exc.value.message
    assert "prune" in exc.value.message
    assert seen and seen[0] in (Path("/var/lib/docker"), tmp_path)


def test_disk_check_passes_with_room(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 10 * 2**30, 90 * 2**30))
    _builder(tmp_path)._check_disk()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 * 2**30, 98 * 2**30, 2 * 2**30))
    _builder(tmp_path, min_free_gib=1.0)._check_disk()  # the threshold is an option


def test_build_checks_disk_before_any_docker_work(monkeypatch, tmp_path):
    b = _builder(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * 2**30, 10 * 2**30, 0))
    monkeypatch.setattr(build_mod, "run_docker", _touched)
    monkeypatch.setattr(build_mod, "render_variant", _touched)
    with pytest.raises(EnvironmentProblem):
        b.build(None)  # the check runs first: nothing rendered, no docker command
