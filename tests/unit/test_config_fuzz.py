"""Property-based: random and malformed matrices/recipes never crash; they exit 2 with one message. A key
added where the schema allows no other key must be that error, naming the key's path.

Runs in-process against the same loaders the CLI uses (ConfigError is what the CLI turns into exit
2), plus a subprocess sample that checks the real exit code and the absence of a traceback.
"""
import copy
import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.yamlio import format_path
from tests.conftest import run_mopt

REPO = Path(__file__).resolve().parent.parent.parent
SHIPPED = yaml.safe_load((REPO / "matrix.yaml").read_text())
RECIPE = yaml.safe_load((REPO / "images/qwen3-embed/image.yaml").read_text())

scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 200), st.floats(allow_nan=False, width=32),
                    st.text(string.printable, max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, prefix + (i,))


MATRIX_PATHS = [p for p in paths(SHIPPED) if p]
RECIPE_PATHS = [p for p in paths(RECIPE) if p]

# The mappings whose keys are names the user chooses (the schema gives additionalProperties a schema, not
# false); None stands for any name. Every other mapping of matrix.yaml and every one of image.yaml is closed.
MATRIX_OPEN = (("bases",), ("images",), ("images", None, "flavours"), ("bases", None, "cuda_tags"))


def added_unknown_key(doc, path, action, open_mappings=()) -> tuple | None:
    """The key path `mutate` adds where the schema allows no other key, else None."""
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    if action != "add" or not isinstance(parent, dict):
        return None
    if any(len(o) == len(path) - 1 and all(a is None or a == b for a, b in zip(o, path[:-1], strict=True))
           for o in open_mappings):
        return None
    return path[:-1] + (f"{path[-1]}_extra",)


def mutate(doc, path, action, value):
    doc = copy.deepcopy(doc)
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if action == "replace":
        parent[key] = value
    elif action == "delete":
        del parent[key]
    elif action == "add" and isinstance(parent, dict):
        parent[f"{key}_extra"] = value
    return doc


def unknown_key_text(added: tuple) -> str:
    """What the error must say about an added key: its key path and that it is unknown."""
    return f"{format_path(added)}: unknown key {added[-1]!r}"


def check_loads_or_config_error(tmp: Path, added: tuple | None = None) -> None:
    try:
        make_plan(load_matrix(tmp / "matrix.yaml"))
    except ConfigError as exc:
        assert exc.exit_code == 2 and exc.message and "\n" not in exc.message.strip()
        if added is not None:
            assert unknown_key_text(added) in exc.message, exc.message
        return
    assert added is None, f"{format_path(added)} was added and the files loaded without an error"


RECIPES = {path.parent.name: path.read_text() for path in sorted(REPO.glob("images/*/image.yaml"))}


def setup_tree(tmp: Path, matrix_text: str, recipe_text: str | None = None) -> None:
    """Every shipped recipe (without one the shipped matrix stops at "recipe file not found" and nothing
    is planned), the qwen3-embed one possibly fuzzed."""
    for name, text in RECIPES.items():
        (tmp / "images" / name).mkdir(parents=True, exist_ok=True)
        (tmp / "images" / name / "image.yaml").write_text(
            recipe_text if recipe_text is not None and name == "qwen3-embed" else text)
    (tmp / "matrix.yaml").write_text(matrix_text)


def test_unmutated_tree_plans(tmp_path):
    """The tree the fuzzers start from loads and plans: a mutation's error is the mutation's doing."""
    setup_tree(tmp_path, (REPO / "matrix.yaml").read_text())
    assert make_plan(load_matrix(tmp_path / "matrix.yaml")).variants


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(MATRIX_PATHS), action=st.sampled_from(["replace", "delete", "add"]), value=values)
def test_mutated_matrix(tmp_path_factory, path, action, value):
    tmp = tmp_path_factory.mktemp("m")
    setup_tree(tmp, yaml.safe_dump(mutate(SHIPPED, path, action, value), sort_keys=False))
    check_loads_or_config_error(tmp, added_unknown_key(SHIPPED, path, action, MATRIX_OPEN))


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(RECIPE_PATHS), action=st.sampled_from(["replace", "delete", "add"]), value=values)
def test_mutated_recipe(tmp_path_factory, path, action, value):
    tmp = tmp_path_factory.mktemp("r")
    setup_tree(tmp, (REPO / "matrix.yaml").read_text(), yaml.safe_dump(mutate(RECIPE, path, action, value)))
    check_loads_or_config_error(tmp, added_unknown_key(RECIPE, path, action))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_random_text_as_matrix(tmp_path_factory, text):
    tmp = tmp_path_factory.mktemp("t")
    setup_tree(tmp, text)
    try:
        load_matrix(tmp / "matrix.yaml")
    except ConfigError as exc:
        assert exc.exit_code == 2 and exc.message


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(MATRIX_PATHS), action=st.sampled_from(["replace", "add"]), value=values)
def test_cli_exit_2_without_traceback(tmp_path_factory, path, action, value):
    tmp = tmp_path_factory.mktemp("c")
    setup_tree(tmp, yaml.safe_dump(mutate(SHIPPED, path, action, value), sort_keys=False))
    added = added_unknown_key(SHIPPED, path, action, MATRIX_OPEN)
    (tmp / "templates").symlink_to(REPO / "templates")
    result = run_mopt("plan", "--format", "json", "--matrix", str(tmp / "matrix.yaml"))
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    if result.returncode == 2:
        assert len(result.stderr.strip().splitlines()) == 1
        assert "matrix.yaml" in result.stderr or "image.yaml" in result.stderr
    if added is not None:
        assert result.returncode == 2 and unknown_key_text(added) in result.stderr, result.stderr
