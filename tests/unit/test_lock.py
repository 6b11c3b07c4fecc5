"""builder.lock's pure parts: the lock key (staleness), reading, merging and the requirements file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.lock import lock_entry, lock_key, partial_entry, read_lock, requirements_text, write_lock
from builder.plan import Axes, BaseImage, Resolved, Variant

VARIANT = Variant(id="minilm-embed:cpu", image="minilm-embed", flavour="embed", backend="torch-inductor",
                  device="cpu", repository="mopt/minilm-embed", tag="cpu", long_tag="1.0.0-cpu", axes=Axes(),
                  resolved=Resolved(python="3.11", base=BaseImage("debian12", "rootfs", "mopt/base:debian12"),
                                    backend_version="2.13.0", runtime_source="pypi", torch="2.13.0"))
RENDERED = {"Dockerfile.base": "FROM debian:bookworm-slim\n", "Dockerfile.runtime": "FROM base\nRUN pip install x\n",
            "Dockerfile.compile": "FROM runtime\n", "Dockerfile": "FROM compiled\n", "compile.sh": "#!/bin/sh\n",
            "requirements.txt": "x==1\n"}
ENTRY = {"variants": ["minilm-embed:cpu"], "base": {"name": "debian", "kind": "image", "ref": "debian:bookworm-slim"},
         "python": ["numpy==2.1.0 --hash=sha256:" + "a" * 64, "torch==2.13.0 --hash=sha256:" + "b" * 64],
         "debian": ["libc6=2.36-9", "python3=3.11.2-1"]}


def _render(directory: Path, **changes: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in {**RENDERED, **changes}.items():
        (directory / name).write_text(text)
    return directory


def _lock(path: Path, render_dir: Path, entry: dict = ENTRY) -> dict:
    write_lock(path, {lock_key(render_dir): entry}, None)
    return read_lock(path)


# --------------------------------------------------------------------------- the lock key
@pytest.mark.parametrize("name", ["Dockerfile.base", "Dockerfile.runtime"])
def test_a_changed_base_or_runtime_dockerfile_changes_the_key(tmp_path, name):
    key = lock_key(_render(tmp_path / "a"))
    changed = lock_key(_render(tmp_path / "b", **{name: RENDERED[name] + "RUN true\n"}))
    assert changed != key and len(changed) == len(key) == 64


def test_a_toolchain_dockerfile_is_part_of_the_key_where_there_is_one(tmp_path):
    # The serving-only runtime leaves out what the toolchain installs again: one entry pins both stages.
    plain = lock_key(_render(tmp_path / "a"))
    with_toolchain = lock_key(_render(tmp_path / "b", **{"Dockerfile.toolchain": "FROM runtime\n"}))
    changed = lock_key(_render(tmp_path / "c", **{"Dockerfile.toolchain": "FROM runtime\nRUN pip install y\n"}))
    assert len({plain, with_toolchain, changed}) == 3


@pytest.mark.parametrize("name", ["Dockerfile.compile", "Dockerfile", "compile.sh", "requirements.txt"])
def test_other_rendered_files_do_not_change_the_key(tmp_path, name):
    assert lock_key(_render(tmp_path / "b", **{name: "changed\n"})) == lock_key(_render(tmp_path / "a"))


def test_the_key_tells_which_file_holds_what(tmp_path):
    # Moving a line from one Dockerfile to the other is another runtime.
    one = _render(tmp_path / "a", **{"Dockerfile.base": "A\n", "Dockerfile.runtime": "B\n"})
    other = _render(tmp_path / "b", **{"Dockerfile.base": "B\n", "Dockerfile.runtime": "A\n"})
    joined = _render(tmp_path / "c", **{"Dockerfile.base": "A\nB\n", "Dockerfile.runtime": ""})
    assert len({lock_key(one), lock_key(other), lock_key(joined)}) == 3


# --------------------------------------------------------------------------- lock_entry: the staleness check
def test_lock_entry_returns_the_runtime_of_an_unchanged_render(tmp_path):
    render_dir = _render(tmp_path / "render")
    lock = _lock(tmp_path / "mopt.lock.json", render_dir)
    _render(render_dir, **{"Dockerfile.compile": "FROM runtime\nRUN compile\n"})  # not part of the runtime
    assert lock_entry(lock, tmp_path / "mopt.lock.json", VARIANT, render_dir) == ENTRY


@pytest.mark.parametrize("name", ["Dockerfile.base", "Dockerfile.runtime"])
def test_lock_entry_refuses_a_changed_dockerfile(tmp_path, name):
    render_dir = _render(tmp_path / "render")
    path = tmp_path / "mopt.lock.json"
    lock = _lock(path, render_dir)
    _render(render_dir, **{name: RENDERED[name] + "RUN apt-get install -y curl\n"})
    key = lock_key(render_dir)
    with pytest.raises(ConfigError) as caught:
        lock_entry(lock, path, VARIANT, render_dir)
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"{path} is stale for minilm-embed:cpu: its base or runtime Dockerfile changed since mopt lock (lock key "
        f"{key[:12]} not in the lock); run mopt lock --select 'minilm-embed:cpu'")


# --------------------------------------------------------------------------- read_lock
def test_read_lock_missing_file(tmp_path):
    path = tmp_path / "mopt.lock.json"
    with pytest.raises(ConfigError) as caught:
        read_lock(path)
    assert str(caught.value) == f"{path}: no lock file (run mopt lock first)"


def test_read_lock_bad_json(tmp_path):
    path = tmp_path / "mopt.lock.json"
    path.write_text('{"schema": 1,\n "runtimes": {')
    with pytest.raises(ConfigError) as caught:
        read_lock(path)
    assert str(caught.value) == f"{path}: not valid JSON: Expecting property name enclosed in double quotes: " \
        "line 2 column 15 (char 28)"


@pytest.mark.parametrize("data", [
    {"schema": 2, "runtimes": {}},
    {"schema": "1", "runtimes": {}},
    {"runtimes": {}},
    {"schema": 1},
    {"schema": 1, "runtimes": []},
    {"schema": 1, "runtimes": None},
    [],  # valid JSON, not an object: one message, not a traceback
    "schema",
])
def test_read_lock_wrong_schema(tmp_path, data):
    path = tmp_path / "mopt.lock.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        read_lock(path)
    assert str(caught.value) == f"{path}: not a mopt lock (schema 1)"


def test_read_lock_returns_the_file(tmp_path):
    path = tmp_path / "mopt.lock.json"
    data = {"schema": 1, "runtimes": {"k" * 64: ENTRY}}
    path.write_text(json.dumps(data))
    assert read_lock(path) == data


# --------------------------------------------------------------------------- write_lock
def test_write_lock_merges_with_the_previous_runtimes(tmp_path):
    path = tmp_path / "mopt.lock.json"
    kept, replaced, new = "1" * 64, "2" * 64, "3" * 64
    previous = {"schema": 1, "runtimes": {kept: {"python": ["a==1"]}, replaced: {"python": ["b==1"]}}}
    snapshot = json.loads(json.dumps(previous))
    write_lock(path, {replaced: {"python": ["b==2"]}, new: {"python": ["c==1"]}}, previous)
    assert read_lock(path) == {"schema": 1, "runtimes": {kept: {"python": ["a==1"]}, replaced: {"python": ["b==2"]},
                                                         new: {"python": ["c==1"]}}}
    assert previous == snapshot  # the caller's lock is not changed in place
    # Stable bytes: sorted keys, two-space indent, one trailing newline (a reviewable diff).
    assert path.read_text() == json.dumps(read_lock(path), indent=2, sort_keys=True) + "\n"


def test_write_lock_drops_runtimes_no_variant_renders_now(tmp_path):
    """A changed template or pin moves a variant's runtime to a new key: the old entry pins nothing that is
    built any more, and a lock that kept it would grow with every change."""
    path = tmp_path / "mopt.lock.json"
    current, stale, new = "1" * 64, "2" * 64, "3" * 64
    previous = {"schema": 1, "runtimes": {current: {"python": ["a==1"]}, stale: {"python": ["b==1"]}}}
    write_lock(path, {new: {"python": ["c==1"]}}, previous, current=frozenset({current, new}))
    assert read_lock(path)["runtimes"] == {current: {"python": ["a==1"]}, new: {"python": ["c==1"]}}


@pytest.mark.parametrize("previous", [None, {}, {"schema": 1, "runtimes": {}}])
def test_write_lock_without_previous_runtimes(tmp_path, previous):
    path = tmp_path / "mopt.lock.json"
    write_lock(path, {"4" * 64: ENTRY}, previous)
    assert read_lock(path) == {"schema": 1, "runtimes": {"4" * 64: ENTRY}}


def test_write_lock_keeps_and_merges_model_pins(tmp_path):
    path = tmp_path / "mopt.lock.json"
    pin = {"repo": "org/m", "revision": "main", "sha": "a" * 40, "files": {"config.json": "c" * 64}}
    write_lock(path, {"4" * 64: ENTRY}, None, {"hf://org/m@main": pin})
    assert read_lock(path)["models"] == {"hf://org/m@main": pin}
    write_lock(path, {"5" * 64: ENTRY}, read_lock(path))  # a later lock of another runtime keeps the pin
    other = dict(pin, repo="org/n")
    write_lock(path, {}, read_lock(path), {"hf://org/n@v1": other})
    assert read_lock(path)["models"] == {"hf://org/m@main": pin, "hf://org/n@v1": other}


# --------------------------------------------------------------------------- requirements_text
@pytest.mark.parametrize("python, text", [
    (ENTRY["python"], f"numpy==2.1.0 --hash=sha256:{'a' * 64}\ntorch==2.13.0 --hash=sha256:{'b' * 64}\n"),
    (["x==1"], "x==1\n"),
    ([], ""),
])
def test_requirements_text_is_one_pinned_line_each(python, text):
    assert requirements_text({"python": python, "debian": []}) == text


# --------------------------------------------------------------------------- partial entries (not buildable here)
CUDA_VARIANT = Variant(
    id="qwen3-embed:cu121-sm86", image="qwen3-embed", flavour="embed", backend="tensorrt", device="cuda",
    repository="mopt/qwen3-embed", tag="cu121-sm86", long_tag="x", axes=Axes(),
    resolved=Resolved(python="3.10", base=BaseImage("nvidia-cuda", "image", "nvidia/cuda:12.1.1-runtime-ubuntu22.04"),
                      backend_version="10.14.1", runtime_source="pypi", cuda="12.1", torch="2.5.1",
                      tensorrt="10.14.1", sm="86"))
CUDA_BASE = {"name": "nvidia-cuda", "kind": "image", "ref": "nvidia/cuda:12.1.1-runtime-ubuntu22.04"}


def test_a_partial_entry_pins_the_planned_versions_and_says_what_is_missing():
    entry = partial_entry(CUDA_VARIANT, dict(CUDA_BASE), "base image nvidia/cuda:12.1.1-runtime-ubuntu22.04 "
                                                         "could not be pulled")
    assert entry["pins"] == {"python": "3.10", "cuda": "12.1", "torch": "2.5.1", "tensorrt": "10.14.1"}
    assert entry["python"] == [] and entry["debian"] == [] and entry["variants"] == [CUDA_VARIANT.id]
    assert entry["missing"] == [
        "the Python packages' hashes and the Debian package versions: the runtime image was not built here "
        "(base image nvidia/cuda:12.1.1-runtime-ubuntu22.04 could not be pulled)",
        "the digest of base nvidia/cuda:12.1.1-runtime-ubuntu22.04: not present here"]
    present = partial_entry(CUDA_VARIANT, {**CUDA_BASE, "image_id": "sha256:" + "c" * 64}, "no GPU")
    assert len(present["missing"]) == 1  # the base is here: only the runtime is missing


def test_a_locked_build_refuses_a_partial_entry(tmp_path):
    render_dir = _render(tmp_path / "render")
    path = tmp_path / "mopt.lock.json"
    lock = _lock(path, render_dir, partial_entry(CUDA_VARIANT, dict(CUDA_BASE), "no registry"))
    with pytest.raises(ConfigError) as caught:
        lock_entry(lock, path, CUDA_VARIANT, render_dir)
    assert str(caught.value) == (
        f"{path} pins qwen3-embed:cu121-sm86 only partly (locked where its runtime could not be built; missing: "
        "the Python packages' hashes and the Debian package versions: the runtime image was not built here "
        "(no registry); the digest of base nvidia/cuda:12.1.1-runtime-ubuntu22.04: not present here); run mopt "
        "lock --select 'qwen3-embed:cu121-sm86' on a host that can build it")
    assert caught.value.exit_code == 2


def test_a_partial_entry_never_replaces_a_complete_one(tmp_path):
    path = tmp_path / "mopt.lock.json"
    key = lock_key(_render(tmp_path / "render"))
    write_lock(path, {key: ENTRY}, None)
    partial = partial_entry(VARIANT, dict(CUDA_BASE), "the index is out of reach")
    written = write_lock(path, {key: partial}, read_lock(path))
    assert written[key] == ENTRY and read_lock(path)["runtimes"][key] == ENTRY
    # ...while a complete entry replaces a partial one, and a partial one fills a gap.
    other = lock_key(_render(tmp_path / "other", **{"Dockerfile.runtime": "FROM base\nRUN pip install y\n"}))
    write_lock(path, {other: partial}, read_lock(path))
    assert read_lock(path)["runtimes"][other] == partial
    write_lock(path, {other: ENTRY}, read_lock(path))
    assert read_lock(path)["runtimes"][other] == ENTRY


@pytest.mark.parametrize(("backend_pins", "expected"), [
    ({"vllm": "0.11.0"}, {"vllm": "0.11.0"}),
    ({"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1"}, {"tensorrt_llm": "1.2.1", "tensorrt": "10.14.1"}),
])
def test_a_partial_entry_pins_each_backend_version(backend_pins, expected):
    variant = Variant(id="x:cu128", image="x", flavour="f", backend="b", device="cuda", repository="mopt/x",
                      tag="cu128", long_tag="l", axes=Axes(),
                      resolved=Resolved.of(backend_pins, python="3.10", cuda="12.8", torch="2.8.0",
                                           base=BaseImage("nvidia-cuda", "image", "nvidia/cuda:x"),
                                           backend_version="v", runtime_source="pypi"))
    entry = partial_entry(variant, dict(CUDA_BASE), "no registry")
    assert entry["pins"] == {"python": "3.10", "cuda": "12.8", "torch": "2.8.0", **expected}
    assert entry["base"] == CUDA_BASE  # the base reference, for the host that completes the lock


def test_a_partial_entry_replaces_an_older_partial_one_and_the_rest_still_merge(tmp_path):
    path = tmp_path / "mopt.lock.json"
    one = lock_key(_render(tmp_path / "one"))
    two = lock_key(_render(tmp_path / "two", **{"Dockerfile.runtime": "FROM base\nRUN pip install y\n"}))
    write_lock(path, {one: ENTRY, two: partial_entry(VARIANT, dict(CUDA_BASE), "old reason")}, None)
    newer = partial_entry(VARIANT, dict(CUDA_BASE), "new reason")
    # `one` is complete and stays; `two` was partial and takes the newer partial entry.
    write_lock(path, dict(sorted({one: newer, two: newer}.items(), key=lambda kv: kv[0] != one)), read_lock(path))
    runtimes = read_lock(path)["runtimes"]
    assert runtimes[one] == ENTRY and runtimes[two] == newer
