"""matrix.yaml rules on a small matrix written here: every error's full message (file, line, key path,
text), unknown keys wherever the schema closes a mapping, and the defaults a loaded Matrix fills in."""
from __future__ import annotations

from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.matrix import DEFAULT_RUNNERS, BaseSpec, Flavour, load_matrix
from tests.conftest import run_mopt

MINI = """\
version: 1
namespace: acme
axes:
  cuda: ["12.4", "12.8"]
  sm: [80, 90]
  torch: ["2.6.0", "2.7.1"]
  python: ["3.11"]
  base: [deb]
bases:
  deb:
    kind: rootfs
    image: acme/base:deb
    suite: bookworm
    python: "3.11"
images:
  minilm-embed:
    recipe: images/minilm-embed/image.yaml
    flavours:
      gpu:
        backend: torch-aot
        device: cuda
        axes:
          cuda: all
          sm: all
        newest: [torch]
        set:
          base: deb
        tag: "cu{cuda_nodot}-sm{sm}"
      cpu:
        backend: torch-aot
        device: cpu
        set:
          base: deb
          torch: "2.7.1"
        tag: cpu
"""
GPU = "images.minilm-embed.flavours.gpu"
CPU = "images.minilm-embed.flavours.cpu"
AXIS_NAMES = "base, cuda, driver, precision, python, sm, tensorrt, tensorrt_llm, torch, vllm"
NV_BASE = '  nv:\n    kind: image\n    ref: "nvidia/cuda:{cuda_tag}"\n    python: "3.10"\n'


def edited(text: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def write(workdir: Path, text: str) -> Path:
    path = workdir / "matrix.yaml"
    path.write_text(text)
    return path


def load_error(workdir: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        load_matrix(write(workdir, text))
    assert exc.value.exit_code == 2
    return exc.value


# --------------------------------------------------------------------------- unknown keys
# (edits, key path, message, the text of the line the error must point at)
UNKNOWN_KEYS = {
    "top level": ((("namespace: acme\n", "namespace: acme\ncolour: red\n"),), "colour",
                  "unknown key 'colour' (allowed: axes, bases, build_id, images, namespace, runners, version)",
                  "colour: red"),
    "flavour": ((("        tag: cpu\n", "        tag: cpu\n        tags: [x]\n"),), f"{CPU}.tags",
                "unknown key 'tags' (allowed: axes, backend, device, exclude, include, long_tag, newest, "
                "runtime_source, set, size_budget_gb, tag)", "tags: [x]"),
    "rootfs base": ((("    suite: bookworm\n", "    suite: bookworm\n    mirrors: [x]\n"),), "bases.deb.mirrors",
                    "unknown key 'mirrors' (allowed: image, kind, mirror, packages, python, source_date_epoch, "
                    "suite, variant)", "mirrors: [x]"),
    "image base": ((("bases:\n", "bases:\n" + NV_BASE + "    cuda_tags: {'12.4': x}\n    suite: jammy\n"),),
                   "bases.nv.suite", "unknown key 'suite' (allowed: cuda_tags, has_cuda, kind, python, ref)",
                   "suite: jammy"),
    "image entry": ((("    recipe: images/", "    recipes: [x]\n    recipe: images/"),), "images.minilm-embed.recipes",
                    "unknown key 'recipes' (allowed: flavours, recipe)", "recipes: [x]"),
    "runners": ((("namespace: acme\n", "namespace: acme\nrunners:\n  gpu: [a]\n  arm: [b]\n"),), "runners.arm",
                "unknown key 'arm' (allowed: cpu, gpu)", "arm: [b]"),
    "axes": ((("  python: [", "  gpus: [a100]\n  python: ["),), "axes.gpus",
             f"unknown key 'gpus' (allowed: {AXIS_NAMES})", "gpus: [a100]"),
    "flavour axes": ((("          sm: all\n", "          sm: all\n          arch: all\n"),), f"{GPU}.axes.arch",
                     f"unknown key 'arch' (allowed: {AXIS_NAMES})", "arch: all"),
    "flavour set": ((("          torch: \"2.7.1\"\n", "          torch: \"2.7.1\"\n          gpu: h200\n"),),
                    f"{CPU}.set.gpu", f"unknown key 'gpu' (allowed: {AXIS_NAMES})", "gpu: h200"),
    "include entry": ((("        newest: [torch]\n", "        newest: [torch]\n        include:\n"
                        "          - {cuda: '12.4'}\n          - {cuda: '12.8', arch: x}\n"),),
                      f"{GPU}.include[1].arch", f"unknown key 'arch' (allowed: {AXIS_NAMES})", "arch: x"),
    "exclude entry": ((("        newest: [torch]\n", "        newest: [torch]\n        exclude:\n"
                        "          - {arch: x}\n"),),
                      f"{GPU}.exclude[0].arch", f"unknown key 'arch' (allowed: {AXIS_NAMES})", "arch: x"),
}


@pytest.mark.parametrize("case", list(UNKNOWN_KEYS), ids=list(UNKNOWN_KEYS))
def test_unknown_key_is_an_error_naming_key_path_and_line(workdir, case):
    edits, key, message, needle = UNKNOWN_KEYS[case]
    text = edited(MINI, *edits)
    exc = load_error(workdir, text)
    path = workdir / "matrix.yaml"
    assert (exc.key, exc.line) == (key, line_of(text, needle))
    assert exc.message == f"{path}:{line_of(text, needle)}: {key}: {message}"


RECIPE = "images/minilm-embed/image.yaml"
RECIPE_KEYS = {
    "recipe top level": ("description:", "colour: red\ndescription:", "colour", "unknown key 'colour' (allowed: "
                         "description, embedding, engine, license, model, name, serve, smoke, source_url, task)"),
    "recipe engine": ("  max_batch: 32\n", "  max_batch: 32\n  max_batchs: 64\n", "engine.max_batchs",
                      "unknown key 'max_batchs' (allowed: attention, compile_mode, cpu_precision, input, max_batch, "
                      "max_batch_tokens, max_seq_len, max_sequences, precision, tensorrt)"),
}


@pytest.mark.parametrize("case", list(RECIPE_KEYS), ids=list(RECIPE_KEYS))
def test_unknown_key_in_a_recipe(workdir, case):
    old, new, key, message = RECIPE_KEYS[case]
    recipe = workdir / RECIPE
    text = edited(recipe.read_text(), (old, new))
    recipe.write_text(text)
    exc = load_error(workdir, MINI)
    needle = new.splitlines()[0] if case == "recipe top level" else new.splitlines()[1]
    assert exc.message == f"{RECIPE}:{line_of(text, needle)}: {key}: {message}"


@pytest.mark.parametrize("recipe_key", [False, True], ids=["matrix", "recipe"])
def test_cli_unknown_key_exits_2_with_one_line(workdir, recipe_key):
    if recipe_key:
        recipe = workdir / RECIPE
        recipe.write_text(edited(recipe.read_text(), ("  max_batch: 32\n", "  max_batch: 32\n  max_batchs: 64\n")))
        text, where = MINI, f"{RECIPE}:"
    else:
        text = edited(MINI, ("        tag: cpu\n", "        tag: cpu\n        tags: [x]\n"))
        where = f"{workdir / 'matrix.yaml'}:{line_of(text, 'tags: [x]')}: {CPU}.tags: unknown key 'tags'"
    result = run_mopt("plan", "--matrix", str(write(workdir, text)))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mopt: error: {where}"), result.stderr
    assert "Traceback" not in result.stderr
    if recipe_key:
        assert "engine.max_batchs: unknown key 'max_batchs'" in lines[0]


# --------------------------------------------------------------------------- rules
NOT_SM = "not a GPU architecture (sm): '8'; write e.g. 86, '8.6', 'sm_86' or 'sm_90a'"
KNOWN_VARIABLES = ("backend, base, build_id, cuda, cuda_nodot, device, driver, flavour, image, precision, python, "
                   "python_nodot, sm, tensorrt, tensorrt_llm, torch, vllm")
GPU_SET = "          base: deb\n        tag: \"cu"  # the end of the gpu flavour's set block
NEWEST = "        newest: [torch]\n"


def rule(case: str, key: str, message: str, needle: str, *edits: tuple[str, str]):
    """One rule: the edits to MINI, the key path, the message, the text of the line the error points at."""
    return pytest.param(edits, key, message, needle, id=case)


RULES = [
    rule("axis value not an sm", "axes.sm[1]", NOT_SM, "- '8'", ("sm: [80, 90]", "sm:\n    - 80\n    - '8'")),
    rule("axis duplicate after normalising", "axes.sm", "duplicate values after normalising: 80, 80", "sm: [80,",
         ("sm: [80, 90]", "sm: [80, '8.0']")),
    rule("axes.base names an unknown base", "axes.base[1]", "unknown base 'nope' (bases: alt, deb)",
         "base: [deb, nope]", ("base: [deb]", "base: [deb, nope]"),
         ("bases:\n", "bases:\n  alt:\n    kind: image\n    ref: a/b\n    python: '3.11'\n")),
    rule("recipe file missing", "images.minilm-embed.recipe", "recipe file not found: images/nope/image.yaml",
         "recipe: images/nope", ("recipe: images/minilm-embed/image.yaml", "recipe: images/nope/image.yaml")),
    rule("cuda_tag without cuda_tags", "bases.nv.cuda_tags", "ref uses {cuda_tag} but no cuda_tags are given", "  nv:",
         ("bases:\n", "bases:\n" + NV_BASE)),
    rule("all of an undeclared axis", f"{GPU}.axes.driver", "'all' but the matrix declares no axes.driver",
         "driver: all", ("          sm: all\n", "          sm: all\n          driver: all\n")),
    rule("flavour axis value not an sm", f"{GPU}.axes.sm[1]", NOT_SM, "sm: [80, '8']",
         ("          sm: all\n", "          sm: [80, '8']\n")),
    rule("flavour axis value undeclared", f"{GPU}.axes.cuda[1]",
         "unknown cuda value '11.2': not in axes.cuda (12.4, 12.8)", "cuda: ['12.8'",
         ("          cuda: all\n", "          cuda: ['12.8', '11.2']\n")),
    rule("flavour crosses an unknown base", f"{GPU}.axes.base[1]", "unknown base 'nope' (bases: deb)",
         "base: [deb, nope]", ("          sm: all\n", "          sm: all\n          base: [deb, nope]\n"),
         ("        set:\n" + GPU_SET, "        tag: \"cu")),
    rule("set names an unknown base", f"{CPU}.set.base", "unknown base 'alpine' (bases: deb, nv)", "base: alpine",
         ("          base: deb\n          torch", "          base: alpine\n          torch"),
         ("bases:\n", "bases:\n" + NV_BASE + "    cuda_tags: {'12.4': x}\n")),
    rule("set value not an sm", f"{GPU}.set.sm", NOT_SM, "sm: '8'",
         (GPU_SET, "          base: deb\n          sm: '8'\n        tag: \"cu"), ("          sm: all\n", "")),
    rule("set value undeclared", f"{CPU}.set.torch", "unknown torch value '2.9.0': not in axes.torch (2.6.0, 2.7.1)",
         "torch: \"2.9.0\"", ("torch: \"2.7.1\"", "torch: \"2.9.0\"")),
    rule("crossed and fixed", f"{GPU}.set.cuda", "cuda is both crossed (axes) and fixed (set)", "cuda: '12.4'",
         (GPU_SET, "          base: deb\n          cuda: '12.4'\n        tag: \"cu")),
    rule("newest of a crossed axis", f"{GPU}.newest[1]", "cuda is crossed or fixed already; newest picks one value",
         "newest: [torch, cuda]", ("newest: [torch]", "newest: [torch, cuda]")),
    rule("newest of a fixed axis", f"{CPU}.newest[1]", "torch is crossed or fixed already; newest picks one value",
         "newest: [python, torch]", ("        tag: cpu\n", "        tag: cpu\n        newest: [python, torch]\n")),
    rule("newest of an undeclared axis", f"{GPU}.newest[1]", "newest: driver but the matrix declares no axes.driver",
         "newest: [torch, driver]", ("newest: [torch]", "newest: [torch, driver]")),
    rule("cpu flavour crossing cuda", f"{CPU}.device", "a cpu flavour cannot have the cuda axis", "device: cpu",
         ("        device: cpu\n", "        device: cpu\n        axes: {cuda: all}\n")),
    rule("cpu flavour fixing sm", f"{CPU}.device", "a cpu flavour cannot have the sm axis", "device: cpu",
         ("          torch: \"2.7.1\"\n", "          torch: \"2.7.1\"\n          sm: 80\n")),
    rule("cuda flavour without sm", f"{GPU}.axes",
         "a cuda flavour must cross or set sm: engines are tied to the GPU arch", "        axes:\n",
         ("          sm: all\n", "")),
    rule("include of an axis the flavour lacks", f"{GPU}.include[0].python",
         "python is not an axis of this flavour", "python: '3.11'}",
         (NEWEST, NEWEST + "        include:\n          - {cuda: '12.4', sm: 80, python: '3.11'}\n")),
    rule("include of an undeclared value", f"{GPU}.include[1].cuda",
         "unknown cuda value '11.0': not in axes.cuda (12.4, 12.8)", "{cuda: '11.0'}",
         (NEWEST, NEWEST + "        include:\n          - {sm: 80}\n          - {cuda: '11.0'}\n")),
    rule("exclude value not an sm", f"{GPU}.exclude[0].sm", NOT_SM, "{sm: '8'}",
         (NEWEST, NEWEST + "        exclude:\n          - {sm: '8'}\n")),
    rule("exclude of an unknown base", f"{GPU}.exclude[1].base", "unknown base 'nope' (bases: deb)", "{base: nope}",
         (NEWEST, NEWEST + "        exclude:\n          - {base: deb}\n          - {base: nope}\n")),
    rule("bad tag template", f"{GPU}.tag", "bad tag template 'cu{cuda': expected '}' before end of string",
         'tag: "cu{cuda"', ('tag: "cu{cuda_nodot}-sm{sm}"', 'tag: "cu{cuda"')),
    rule("unknown tag variable", f"{GPU}.tag",
         f"unknown template variable {{arch}} in 'cu{{cuda_nodot}}-{{arch}}' (known: {KNOWN_VARIABLES})", "{arch}",
         ('tag: "cu{cuda_nodot}-sm{sm}"', 'tag: "cu{cuda_nodot}-{arch}"')),
    rule("unknown long_tag variable", f"{CPU}.long_tag",
         f"unknown template variable {{tag}} in 'cpu-{{tag}}' (known: {KNOWN_VARIABLES})", "long_tag:",
         ("        tag: cpu\n", "        tag: cpu\n        long_tag: cpu-{tag}\n")),
    rule("bad long_tag template", f"{CPU}.long_tag",
         "bad tag template 'cpu-{': Single '{' encountered in format string", "long_tag:",
         ("        tag: cpu\n", "        tag: cpu\n        long_tag: 'cpu-{'\n")),
    rule("flavour without a base", f"{CPU}.set", "every flavour needs a base: set it (set: {base: NAME}) or cross it",
         "        set:\n", ("          base: deb\n          torch", "          torch")),
]


@pytest.mark.parametrize(("edits", "key", "message", "needle"), RULES)
def test_rule_errors(workdir, edits, key, message, needle):
    text = edited(MINI, *edits)
    exc = load_error(workdir, text)
    if needle.endswith("\n"):  # a block key that appears more than once: the one inside the named flavour
        flavour = key.split(".")[3]
        start = line_of(text, f"      {flavour}:")
        line = start + text.splitlines()[start:].index(needle.rstrip("\n")) + 1
    else:
        line = line_of(text, needle)
    assert exc.message == f"{workdir / 'matrix.yaml'}:{line}: {key}: {message}"


def test_no_bases_at_all(workdir):
    text = edited(MINI, ("  base: [deb]\n", ""), ("bases:\n  deb:\n    kind: rootfs\n    image: acme/base:deb\n"
                                                   "    suite: bookworm\n    python: \"3.11\"\n", ""))
    exc = load_error(workdir, text)
    assert exc.message == (f"{workdir / 'matrix.yaml'}:{line_of(text, 'base: deb')}: {GPU}.set.base: "
                           "unknown base 'deb' (bases: none)")


# --------------------------------------------------------------------------- what a valid matrix loads as
def test_flavours_as_loaded(workdir):
    matrix = load_matrix(write(workdir, MINI))
    assert matrix.path == workdir / "matrix.yaml" and matrix.namespace == "acme"
    assert matrix.axes == {"cuda": ("12.4", "12.8"), "sm": ("80", "90"), "torch": ("2.6.0", "2.7.1"),
                           "python": ("3.11",), "base": ("deb",)}
    (entry,) = matrix.images
    assert entry.name == "minilm-embed" and entry.recipe.name == "minilm-embed"
    assert entry.flavours == (
        Flavour(name="gpu", backend="torch-aot", device="cuda",
                crossed=(("cuda", ("12.4", "12.8")), ("sm", ("80", "90"))), newest=("torch",), fixed={"base": "deb"},
                include=(), exclude=(), tag="cu{cuda_nodot}-sm{sm}", long_tag="", runtime_source="pypi"),
        Flavour(name="cpu", backend="torch-aot", device="cpu", crossed=(), newest=(),
                fixed={"base": "deb", "torch": "2.7.1"}, include=(), exclude=(), tag="cpu", long_tag="",
                runtime_source="pypi"),
    )


def test_flavour_values_normalised_and_options_kept(workdir):
    text = edited(
        MINI,
        ("          cuda: all\n          sm: all\n", "          sm: ['sm_90', '8.0']\n          base: [deb]\n"),
        ("        newest: [torch]\n        set:\n          base: deb\n",
         "        newest: [torch]\n        set:\n          cuda: '12.8'\n"
         "        include:\n          - {sm: 'sm_80', cuda: '12.8', base: deb}\n"  # cuda is fixed: may be named
         "        exclude:\n          - {sm: '9.0'}\n          - {python: '3.11'}\n"),  # exclude: any declared axis
        ('tag: "cu{cuda_nodot}-sm{sm}"\n', 'tag: "cu{cuda_nodot}-sm{sm}"\n        long_tag: "x{sm}-{build_id}"\n'
                                           '        runtime_source: nvidia-pip\n'),
    )
    gpu = load_matrix(write(workdir, text)).images[0].flavours[0]
    assert gpu.crossed == (("sm", ("90", "80")), ("base", ("deb",)))
    assert gpu.fixed == {"cuda": "12.8"}
    assert gpu.include == ({"sm": "80", "cuda": "12.8", "base": "deb"},)
    assert gpu.exclude == ({"sm": "90"}, {"python": "3.11"})
    assert (gpu.long_tag, gpu.runtime_source) == ("x{sm}-{build_id}", "nvidia-pip")


def test_cuda_flavour_may_set_sm_instead_of_crossing_it(workdir):
    text = edited(MINI, ("          sm: all\n", ""), ("          base: deb\n        tag: \"cu",
                                                      "          base: deb\n          sm: sm_90\n        tag: \"cu"))
    gpu = load_matrix(write(workdir, text)).images[0].flavours[0]
    assert gpu.crossed == (("cuda", ("12.4", "12.8")),) and gpu.fixed == {"base": "deb", "sm": "90"}


def test_matrix_without_a_base_axis(workdir):
    matrix = load_matrix(write(workdir, edited(MINI, ("  base: [deb]\n", ""))))
    assert "base" not in matrix.axes


def test_defaults(workdir):
    matrix = load_matrix(write(workdir, edited(MINI, ("bases:\n", "bases:\n  plain:\n    kind: image\n"
                                                                  "    ref: debian:12\n    python: '3.11'\n"))))
    assert matrix.build_id == "1"
    assert matrix.runners == DEFAULT_RUNNERS == {"gpu": ("self-hosted", "linux", "x64", "gpu-sm{sm}"),
                                                 "cpu": ("ubuntu-24.04",)}
    assert matrix.bases == {
        "deb": BaseSpec(name="deb", kind="rootfs", python="3.11", image="acme/base:deb", ref="", suite="bookworm",
                        mirror="http://deb.debian.org/debian", variant="minbase", packages=(), source_date_epoch=0,
                        cuda_tags={}, has_cuda=False),
        "plain": BaseSpec(name="plain", kind="image", python="3.11", image="", ref="debian:12", suite="",
                          mirror="http://deb.debian.org/debian", variant="minbase", packages=(), source_date_epoch=0,
                          cuda_tags={}, has_cuda=False),
    }


def test_every_option_given(workdir):
    text = edited(
        MINI,
        ("namespace: acme\n", "namespace: acme\nbuild_id: '7'\nrunners:\n  gpu: [gpu-box]\n"),
        ("    suite: bookworm\n", "    suite: trixie\n    mirror: http://mirror.example/debian\n    variant: apt\n"
                                  "    packages: [a, b]\n    source_date_epoch: 1700000000\n"),
        ("bases:\n", "bases:\n" + NV_BASE + "    cuda_tags: {'12.4': 12.4.1-runtime}\n    has_cuda: true\n"),
    )
    matrix = load_matrix(write(workdir, text))
    assert matrix.build_id == "7"
    assert matrix.runners == {"gpu": ("gpu-box",), "cpu": ("ubuntu-24.04",)}  # cpu keeps its default
    assert matrix.bases == {
        "nv": BaseSpec(name="nv", kind="image", python="3.10", ref="nvidia/cuda:{cuda_tag}",
                       cuda_tags={"12.4": "12.4.1-runtime"}, has_cuda=True),
        "deb": BaseSpec(name="deb", kind="rootfs", python="3.11", image="acme/base:deb", suite="trixie",
                        mirror="http://mirror.example/debian", variant="apt", packages=("a", "b"),
                        source_date_epoch=1700000000),
    }


def test_image_base_without_cuda_tag_needs_no_cuda_tags(workdir):
    text = edited(MINI, ("bases:\n", "bases:\n  nv:\n    kind: image\n    ref: nvidia/cuda:12.4.1-runtime\n"
                                     "    python: '3.10'\n"))
    assert load_matrix(write(workdir, text)).bases["nv"].cuda_tags == {}


def test_an_unknown_backend_names_the_known_ones(workdir):
    text = edited(MINI, ("      cpu:\n        backend: torch-aot", "      cpu:\n        backend: torch-aott"))
    err = load_error(workdir, text)
    assert str(err) == (f"{workdir / 'matrix.yaml'}:{line_of(text, 'torch-aott')}: {CPU}.backend: unknown backend "
                        "'torch-aott' (backends: tensorrt, tensorrt-llm, torch-aot, torch-inductor, vllm)")
