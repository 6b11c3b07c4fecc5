"""builder.render beyond the golden files: the template context, the manifest and its stage keys, template errors
(with file and line), what render() writes on a re-render, and UTF-8 output whatever the locale.

Most tests render tiny templates of their own, so they check the renderer, not templates/ (which has goldens)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

import builder
from builder import render as render_mod
from builder.errors import ConfigError
from builder.hashing import dump_json, sha256_text, tree_digest
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import render, render_variant

REPO = Path(__file__).resolve().parent.parent.parent
DIGEST = "0" * 64


@pytest.fixture(scope="module")
def planned():
    matrix = load_matrix(REPO / "matrix.yaml")
    return matrix, make_plan(matrix).variants


def _variant(variants, variant_id):
    return next(v for v in variants if v.id == variant_id)


def _templates(root: Path, override: dict[str, str] | None = None) -> Path:
    """Minimal templates for every backend; `override` adds or replaces files."""
    files = {"base.Dockerfile.j2": "FROM {{ base.ref }}\n", "compile.sh.j2": "echo {{ id }}\n",
             "final.Dockerfile.j2": "FROM runtime\nLABEL tag={{ tag }}\n",
             "model-runtime.Dockerfile.j2": "FROM compiler\nLABEL tag={{ tag }}\n"}
    for backend in ("torch-aot", "torch-inductor", "tensorrt", "tensorrt-llm", "vllm"):
        files[f"runtime-{backend}.Dockerfile.j2"] = f"FROM base\nRUN echo {backend}\n"
    files.update(override or {})
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


# ------------------------------------------------------------------------------ context

def test_context_of_a_cuda_variant(planned):
    matrix, variants = planned
    variant = _variant(variants, "qwen3-embed:cu128-sm90-aot")
    ctx = render_mod._context(matrix, variant)
    assert {k: ctx[k] for k in ("id", "image", "flavour", "backend", "device", "repository", "tag", "long_tag")} == {
        "id": variant.id, "image": "qwen3-embed", "flavour": "aot", "backend": "torch-aot", "device": "cuda",
        "repository": variant.repository, "tag": "cu128-sm90-aot", "long_tag": variant.long_tag}
    assert (ctx["cuda_nodot"], ctx["cuda_major"]) == ("128", "12")
    # {cuda_nodot} in data/defaults.yaml's indexes is filled per variant; other indexes are left alone
    assert ctx["indexes"] == {"nvidia": "https://pypi.nvidia.com", "pytorch_cuda": "https://download.pytorch.org/whl/cu128"}
    assert ctx["mounts"] == {"model": "/opt/mopt/model", "inputs": "/mopt/inputs", "out": "/mopt/out"}
    assert ctx["runtime_source"] == "pypi" and ctx["python"] == variant.resolved.python


def test_context_of_a_cpu_variant(planned):
    matrix, variants = planned
    ctx = render_mod._context(matrix, _variant(variants, "minilm-embed:cpu"))
    assert (ctx["cuda_nodot"], ctx["cuda_major"]) == ("", "")
    assert ctx["image"] == "minilm-embed" and ctx["device"] == "cpu"
    assert ctx["source_date_epoch"] == 1735689600     # matrix.yaml's debian12 rootfs


def _with_bases(matrix, **epochs):
    """The matrix with its rootfs base replaced by rootfs bases of the given SOURCE_DATE_EPOCHs."""
    rootfs = next(b for b in matrix.bases.values() if b.kind == "rootfs")
    bases = {n: b for n, b in matrix.bases.items() if b.kind != "rootfs"}
    bases.update({n: dataclasses.replace(rootfs, name=n, source_date_epoch=e) for n, e in epochs.items()})
    return dataclasses.replace(matrix, bases=bases)


def test_source_date_epoch_is_the_newest_rootfs_base(planned):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    newest = _with_bases(matrix, old=1600000000, new=1700000000, mid=1650000000)
    assert render_mod._context(newest, variant)["source_date_epoch"] == 1700000000
    # image bases (pulled nvidia/cuda) carry no epoch of their own; with no rootfs base the epoch is 0
    assert render_mod._source_date_epoch(_with_bases(matrix)) == 0


# ------------------------------------------------------------------------------ manifest and stage keys

def test_manifest_contents(planned, tmp_path):
    matrix, variants = planned
    variant = _variant(variants, "qwen3-embed:cu128-sm90-aot")
    rendered = render_variant(matrix, variant, _templates(tmp_path / "t"), DIGEST, variants)
    m = rendered.manifest
    assert json.loads(rendered.files["manifest.json"]) == m
    assert (m["schema"], m["mopt_version"], m["id"], m["tag"], m["backend"], m["device"]) == (
        1, builder.__version__, variant.id, "cu128-sm90-aot", "torch-aot", "cuda")
    recipe = next(e.recipe for e in matrix.images if e.name == "qwen3-embed")
    assert m["recipe"] == {"path": "images/qwen3-embed/image.yaml", "digest": recipe.digest}
    assert m["context"] == {"mopt_runtime": DIGEST}
    assert [(s["name"], s["file"], s.get("parent")) for s in m["stages"]] == [
        ("base", "Dockerfile.base", None), ("runtime", "Dockerfile.runtime", "base"),
        ("compile", "compile.sh", "runtime"), ("final", "Dockerfile.final", "runtime")]
    base, runtime, compile_, final = m["stages"]
    assert (base["from"], base["base_kind"]) == (variant.resolved.base.ref, variant.resolved.base.kind)
    assert runtime["context"] == ["mopt_runtime"] and compile_["gpu"] is True
    # each key hashes the stage's own text with its parent's key
    assert base["key"] == sha256_text("base", rendered.files["Dockerfile.base"])
    assert runtime["key"] == sha256_text("runtime", base["key"], rendered.files["Dockerfile.runtime"], DIGEST)
    assert compile_["key"] == sha256_text("compile", runtime["key"], rendered.files["compile.sh"],
                                          rendered.files["params.json"], rendered.files["image-info.json"],
                                          rendered.files["smoke-inputs.json"])
    assert final["key"] == sha256_text("final", compile_["key"], rendered.files["Dockerfile.final"])
    cpu = render_variant(matrix, _variant(variants, "minilm-embed:cpu"), tmp_path / "t", DIGEST).manifest
    assert cpu["stages"][2]["gpu"] is False


@pytest.mark.parametrize("changed,moved", [
    ("base.Dockerfile.j2", {"base", "runtime", "compile", "final"}),
    ("runtime-torch-aot.Dockerfile.j2", {"runtime", "compile", "final"}),
    ("compile.sh.j2", {"compile", "final"}),
    ("final.Dockerfile.j2", {"final"}),
])
def test_stage_keys_move_with_their_inputs(planned, tmp_path, changed, moved):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")

    def keys(root):
        return {s["name"]: s["key"] for s in render_variant(matrix, variant, root, DIGEST).manifest["stages"]}

    a = keys(_templates(tmp_path / "a"))
    b_root = _templates(tmp_path / "b")
    (b_root / changed).write_text((b_root / changed).read_text() + "# changed\n")
    b = keys(b_root)
    assert {name for name in a if a[name] != b[name]} == moved


def test_sha256_text_separates_parts():
    assert sha256_text("a", "b") == hashlib.sha256(b"a\0b\0").hexdigest()
    assert sha256_text("ab", "") != sha256_text("a", "b")


def test_recipe_outside_the_matrix_directory_keeps_its_path(planned, tmp_path):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    elsewhere = tmp_path / "recipes" / "image.yaml"
    images = tuple(dataclasses.replace(e, recipe=dataclasses.replace(e.recipe, path=elsewhere))
                   if e.name == "minilm-embed" else e for e in matrix.images)
    moved = dataclasses.replace(matrix, images=images)
    manifest = render_variant(moved, variant, _templates(tmp_path / "t"), DIGEST).manifest
    assert manifest["recipe"]["path"] == str(elsewhere)


def test_dump_json_is_sorted_indented_and_keeps_unicode():
    assert dump_json({"b": "naïve – ok", "a": [1]}) == '{\n  "a": [\n    1\n  ],\n  "b": "naïve – ok"\n}\n'


# ------------------------------------------------------------------------------ template errors

def test_missing_template(planned, tmp_path):
    matrix, variants = planned
    root = _templates(tmp_path / "t")
    (root / "runtime-torch-aot.Dockerfile.j2").unlink()
    with pytest.raises(ConfigError) as exc:
        render_variant(matrix, _variant(variants, "minilm-embed:cpu"), root, DIGEST)
    assert str(exc.value) == ("templates/runtime-torch-aot.Dockerfile.j2: template not found: "
                              "runtime-torch-aot.Dockerfile.j2")
    assert exc.value.file == "templates/runtime-torch-aot.Dockerfile.j2"


def test_syntax_error_names_the_template_and_line(planned, tmp_path):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    root = _templates(tmp_path / "t", {"final.Dockerfile.j2": "FROM runtime\n\n{% if %}\n"})
    with pytest.raises(ConfigError) as exc:
        render_variant(matrix, variant, root, DIGEST)
    assert (exc.value.file, exc.value.line) == ("templates/final.Dockerfile.j2", 3)
    assert str(exc.value).startswith("templates/final.Dockerfile.j2:3: template syntax error: ")


def test_syntax_error_in_an_included_template_names_that_file(planned, tmp_path):
    matrix, variants = planned
    root = _templates(tmp_path / "t", {"base.Dockerfile.j2": 'FROM x\n{% include "_part.j2" %}\n',
                                       "_part.j2": "ok\nok\n{% for %}\n"})
    with pytest.raises(ConfigError) as exc:
        render_variant(matrix, _variant(variants, "minilm-embed:cpu"), root, DIGEST)
    assert (exc.value.file, exc.value.line) == ("templates/_part.j2", 3)


def test_undefined_variable_names_the_template(planned, tmp_path):
    matrix, variants = planned
    root = _templates(tmp_path / "t", {"compile.sh.j2": "echo {{ no_such_thing }}\n"})
    with pytest.raises(ConfigError) as exc:
        render_variant(matrix, _variant(variants, "minilm-embed:cpu"), root, DIGEST)
    assert str(exc.value) == "templates/compile.sh.j2: template variable error: 'no_such_thing' is undefined"


def test_missing_templates_directory(planned, tmp_path):
    matrix, variants = planned
    with pytest.raises(ConfigError) as exc:
        render(matrix, variants[:1], tmp_path / "out", tmp_path / "nope")
    assert str(exc.value) == f"{tmp_path / 'nope'}: templates directory not found"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ render() on disk

def test_runtime_digest_covers_every_file_the_runtime_stage_copies(planned, tmp_path, monkeypatch):
    matrix, variants = planned
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "server.py").write_text("print('hi')\n")
    (runtime / "README.md").write_text("notes\n")
    monkeypatch.setattr(render_mod, "RUNTIME_PACKAGE", runtime)
    templates = _templates(tmp_path / "t")

    def digest():
        (directory,) = render(matrix, (_variant(variants, "minilm-embed:cpu"),), tmp_path / "out", templates)
        return json.loads((directory / "manifest.json").read_text())["context"]["mopt_runtime"]

    first = digest()
    assert first == tree_digest(runtime) != tree_digest(runtime, "**/*.py")
    (runtime / "README.md").write_text("other notes\n")  # data the stage copies: a new key
    second = digest()
    assert second != first
    (runtime / "server.py").write_text("print('bye')\n")
    assert digest() not in (first, second)


def test_selection_without_all_variants_knows_its_own_tags(planned, tmp_path):
    matrix, variants = planned
    pair = (_variant(variants, "qwen3-embed:cu128-sm86-aot"), _variant(variants, "qwen3-embed:cu128-sm90-aot"))
    dirs = render(matrix, pair, tmp_path / "out", _templates(tmp_path / "t"))
    assert [d.relative_to(tmp_path / "out").as_posix() for d in dirs] == ["qwen3-embed/cu128-sm86-aot",
                                                                           "qwen3-embed/cu128-sm90-aot"]
    info = json.loads((dirs[1] / "image-info.json").read_text())
    assert info["tags_by_sm"] == {"86": "cu128-sm86-aot", "90": "cu128-sm90-aot"}


def test_rerender_into_the_same_directory(planned, tmp_path):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    templates = _templates(tmp_path / "t")
    (directory,) = render(matrix, (variant,), tmp_path / "out", templates)
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["Dockerfile.base", "Dockerfile.final", "Dockerfile.model-runtime", "Dockerfile.runtime",
                     "compile.sh", "image-info.json", "manifest.json", "params.json", "runtime-params.json",
                     "smoke-inputs.json"]
    original = (directory / "Dockerfile.final").read_text()
    (directory / "Dockerfile.final").write_text("tampered\n")
    old = 1_000_000_000
    os.utime(directory / "compile.sh", (old, old))
    assert render(matrix, (variant,), tmp_path / "out", templates) == [directory]
    assert (directory / "Dockerfile.final").read_text() == original       # a changed file is rewritten
    assert (directory / "compile.sh").stat().st_mtime == old              # an unchanged one is left alone


def test_files_are_utf8_whatever_the_locale(planned, tmp_path, ascii_locale):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    images = tuple(dataclasses.replace(e, recipe=dataclasses.replace(e.recipe, smoke_inputs=("naïve café",)))
                   if e.name == "minilm-embed" else e for e in matrix.images)
    text_matrix = dataclasses.replace(matrix, images=images)
    templates = _templates(tmp_path / "t")
    (directory,) = render(text_matrix, (variant,), tmp_path / "out", templates)
    assert (directory / "smoke-inputs.json").read_bytes() == '[\n  "naïve café"\n]\n'.encode()
    render(text_matrix, (variant,), tmp_path / "out", templates)           # reads the existing files back
    assert json.loads((directory / "manifest.json").read_bytes().decode())["smoke"]["inputs"] == ["naïve café"]


# ------------------------------------------------------------------------------ input form

def _with_engine(matrix, variant, **changes):
    """A copy of the variant's recipe with engine fields changed."""
    recipe = matrix.image(variant.image).recipe
    return dataclasses.replace(recipe, engine=dataclasses.replace(recipe.engine, **changes))


@pytest.mark.parametrize("variant_id, family, packed", [
    ("qwen3-embed:cu130-sm90-aot", "decoder", {"max_sequences": 512, "max_batch_tokens": 32768}),
    ("minilm-embed:cpu", "encoder", {"max_sequences": 32, "max_batch_tokens": 32 * 256}),
    ("qwen3-embed:cu128-sm90-vllm", "decoder", None),  # vllm: no packed engines, padded by default
])
def test_the_input_form_is_the_backends_choice_by_device_and_family(planned, variant_id, family, packed):
    matrix, variants = planned
    variant = _variant(variants, variant_id)
    assert matrix.image(variant.image).recipe.family == family
    assert render_mod._context(matrix, variant)["packed"] == packed


def test_a_recipe_overrides_the_input_form_and_is_checked(planned):
    matrix, variants = planned
    variant = _variant(variants, "minilm-embed:cpu")
    spec = render_mod.backend(variant.backend)
    padded = _with_engine(matrix, variant, input="padded")
    assert render_mod._packed(variant, padded, spec) is None
    custom = _with_engine(matrix, variant, max_sequences=64, max_batch_tokens=256)
    assert render_mod._packed(variant, custom, spec) == {"max_sequences": 64, "max_batch_tokens": 256}
    # The budget must hold one full sequence and at most every sequence full.
    for tokens in (255, 64 * 256 + 1):
        with pytest.raises(ConfigError) as err:
            render_mod._packed(variant, _with_engine(matrix, variant, max_sequences=64, max_batch_tokens=tokens), spec)
        assert err.value.message == (f"minilm-embed:cpu: engine.max_batch_tokens {tokens} must be in "
                                     "max_seq_len..sequences x max_seq_len (256..16384)")
    assert render_mod._packed(variant, _with_engine(matrix, variant, max_sequences=1, max_batch_tokens=256), spec)
    vllm = _variant(variants, "minilm-embed:cpu-vllm")
    asked = _with_engine(matrix, vllm, input="packed")
    with pytest.raises(ConfigError, match=r"minilm-embed:cpu-vllm: engine.input packed needs a backend that compiles "
                                          r"packed engines \(torch-aot, torch-inductor\), not vllm"):
        render_mod._packed(vllm, asked, render_mod.backend("vllm"))


def test_the_family_follows_attention_and_pooling(planned):
    matrix, variants = planned
    recipe = matrix.image("minilm-embed").recipe
    assert recipe.family == "encoder"
    assert dataclasses.replace(recipe, pooling="last").family == "decoder"
    causal = dataclasses.replace(recipe.engine, attention="causal")
    assert dataclasses.replace(recipe, engine=causal).family == "decoder"
    spec = render_mod.backend("torch-aot")
    assert spec.input_form("cuda", "decoder") == "packed"
    assert render_mod.backend("vllm").input_form("cpu", "encoder") == "padded"
