"""Import boundaries, checked on the source (AST): the host package never imports the in-image runtime
(it only copies it into images, builder/build.py, and digests it, builder/render.py), the runtime never
imports the host (it ships alone as /opt/mopt/mopt_runtime), the host never imports torch or TensorRT,
and engine backends share code through backends/torch_common.py, never through each other's private
names or the guard."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
BUILDER = REPO / "builder"
RUNTIME = BUILDER / "runtime"
BACKENDS = RUNTIME / "backends"
HEAVY = ("torch", "tensorrt", "tensorrt_llm", "vllm", "transformers")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(absolute module, names imported from it, line) for every import in the file, relative ones resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names = tuple(alias.name for alias in node.names)
            out.append((module, names, node.lineno))
            out += [(f"{module}.{name}", (), node.lineno) for name in names]  # `from . import x` imports a module
    return out


def _py(root: Path, exclude: Path | None = None) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if exclude is None or exclude not in p.parents)


def _violations(files: list[Path], bad) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {module}"
            for path in files for module, names, line in imports(path) if bad(module, names)]


def test_imports_are_resolved_the_way_python_does():
    # The checker itself: a relative import in a backend resolves into builder.runtime.
    found = {m for m, _, _ in imports(BACKENDS / "torch_aot.py")}
    assert "builder.runtime.params" in found


# The contract host and runtime share (builder/runtime/params.py): the host's only imports of the runtime.
CONTRACT = ("builder.runtime.params", "builder.runtime.errors", "builder.runtime.families", "builder.runtime.gate")


def _runtime_beyond_contract(module: str) -> bool:
    return (module == "builder.runtime" or module.startswith("builder.runtime.")) and not any(
        module == c or module.startswith(c + ".") for c in CONTRACT)


def test_host_never_imports_the_runtime_or_heavy_libraries():
    bad = _violations(_py(BUILDER, exclude=RUNTIME), lambda m, _: _runtime_beyond_contract(m)
                      or m.split(".")[0] in HEAVY)
    assert not bad, "the host imports the in-image runtime or torch/TensorRT:\n" + "\n".join(bad)


def test_the_contract_is_light():
    """What the host imports of the runtime (and what that imports) never reaches torch, jinja2 or docker."""
    modules = {_module_name(p): p for p in _py(RUNTIME)}
    seen, todo = set(), list(CONTRACT)
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        for module, _, line in imports(modules[name]):
            assert module.split(".")[0] not in (*HEAVY, "jinja2", "docker", "numpy"), f"{name}:{line}: {module}"
            todo.append(module)
    assert {"builder.runtime.params", "builder.runtime.backends.registry"} <= seen
    # and for real, package __init__ files included, in a fresh interpreter
    probe = ("import sys; import builder.runtime.params, builder.runtime.errors; "
             "print(sorted(m for m in ('torch', 'numpy', 'jinja2', 'docker', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_cli_imports_no_parser_generator():
    """What every mopt command imports (the CLI, the compatibility KB and its JSON schema validation) does not
    pull in rfc3987-syntax, which builds an Earley parser (lark) at import: jsonschema imports it whenever it
    is installed, and it added 1.0 s to each command (pyproject.toml's note on cyclonedx-python-lib)."""
    probe = ("import sys; import builder.cli, builder.compat, builder.attest.sbom; "
             "print(sorted(m for m in ('lark', 'rfc3987_syntax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_runtime_never_imports_the_host():
    def host(module: str, _names) -> bool:
        return module.split(".")[0] == "builder" and not module.startswith("builder.runtime")

    bad = _violations(_py(RUNTIME), host)
    assert not bad, "the runtime imports the host package (it ships without it):\n" + "\n".join(bad)


@pytest.mark.parametrize("path", sorted(p for p in BACKENDS.glob("*.py") if p.name != "__init__.py"),
                         ids=lambda p: p.name)
def test_backends_do_not_reach_into_each_other_or_the_guard(path):
    own = _module_name(path)
    siblings = {_module_name(p) for p in BACKENDS.glob("*.py")} - {own, "builder.runtime.backends"}
    shared = "builder.runtime.backends.torch_common"

    def bad(module: str, names: tuple[str, ...]) -> bool:
        if module == "builder.runtime.guard":
            return True
        if module in siblings and module != shared:
            return True  # another backend's module: share code through torch_common instead
        return module == shared and any(n.startswith("_") for n in names)

    found = _violations([path], bad)
    assert not found, "a backend imports another backend, a private name or the guard:\n" + "\n".join(found)


def test_one_import_style_inside_the_package():
    # Modules of the package import each other relatively: the runtime has to (it ships as mopt_runtime),
    # and the host does the same so a module reads the same wherever it lives.
    absolute = [f"{path.relative_to(REPO)}:{node.lineno}"
                for path in _py(BUILDER)
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0]
                    == "builder") or (isinstance(node, ast.Import)
                                      and any(a.name.split(".")[0] == "builder" for a in node.names))]
    assert not absolute, "absolute imports of builder inside builder/:\n" + "\n".join(absolute)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """Every import counts: module level, inside functions and under TYPE_CHECKING (a cycle hidden in a
    function is still two modules that cannot be understood, or changed, one without the other)."""
    modules = {_module_name(p): p for p in _py(BUILDER)}
    graph = {name: {m for m, _, _ in imports(path) if m in modules and m != name} for name, path in modules.items()}
    assert _cycles(graph) == []


def test_host_and_runtime_read_one_description_per_backend():
    """builder/runtime/backends/<name>.yaml: the host's BackendSpec and the runtime's registry come from
    the same files, so they cannot name different backends or disagree on what both state."""
    from builder.backends import backends, backends_dir
    from builder.runtime.backends.registry import BACKENDS, DESCRIPTIONS

    assert backends_dir().resolve() == DESCRIPTIONS.resolve()
    host = backends()
    assert set(host) == set(BACKENDS) and len(host) == len(list(DESCRIPTIONS.glob("*.yaml")))
    for name, spec in host.items():
        assert spec.own_server == BACKENDS[name].own_server, name
        assert bool(spec.input_forms) == BACKENDS[name].packed_input, name
        assert (RUNTIME / "backends" / f"{BACKENDS[name].module}.py").is_file(), name
