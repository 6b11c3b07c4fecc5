"""Plan rules on the small matrix of test_matrix_rules: expansion, newest picks, tags (short, long, default
long), rejections and their ids and reasons, collisions, --select, and the JSON a plan is written as."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from builder import compat
from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import BaseImage, Plan, _default_long_tag, make_plan
from tests.unit.test_matrix_rules import CPU, MINI, NV_BASE, edited, write

# The gpu flavour on a base with CUDA (a torch-aot engine on a plain Debian base takes CUDA from PyPI
# alone, which this small matrix's CUDA 12 lines cannot: test_cuda_from_pypi_plan.py).
PLAN_MINI = edited(MINI, ("  base: [deb]\n", "  base: [deb, cu]\n"),
                   ("images:\n", "  cu:\n    kind: image\n    ref: acme/cuda:12\n    has_cuda: true\n"
                                  "    python: \"3.11\"\nimages:\n"),
                   ("        set:\n          base: deb\n        tag: \"cu",
                    "        set:\n          base: cu\n        tag: \"cu"))
GPU_SET = "        set:\n          base: cu\n        tag: \"cu"
CPU_TAG = "        tag: cpu\n"


def plan_of(workdir: Path, *edits: tuple[str, str], select: tuple[str, ...] = ()) -> Plan:
    return make_plan(load_matrix(write(workdir, edited(PLAN_MINI, *edits))), select)


def plan_error(workdir: Path, *edits: tuple[str, str], select: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as exc:
        plan_of(workdir, *edits, select=select)
    assert exc.value.exit_code == 2
    return exc.value.message


def test_mini_plan(workdir):
    plan = plan_of(workdir)
    assert [(v.id, v.long_tag) for v in plan.variants] == [
        ("minilm-embed:cu124-sm80", "cu124-sm80-cuda12.4-torch2.6.0-b1"),
        ("minilm-embed:cu124-sm90", "cu124-sm90-cuda12.4-torch2.6.0-b1"),
        ("minilm-embed:cu128-sm80", "cu128-sm80-cuda12.8-torch2.7.1-b1"),  # newest torch with a 12.8 build
        ("minilm-embed:cu128-sm90", "cu128-sm90-cuda12.8-torch2.7.1-b1"),
        ("minilm-embed:cpu", "cpu-torch2.7.1-b1"),
    ]
    assert (plan.rejected, plan.combinations, plan.warnings) == ((), 5, ())
    gpu, cpu = plan.variants[0], plan.variants[-1]
    assert (gpu.image, gpu.flavour, gpu.backend, gpu.device, gpu.repository, gpu.tag) == (
        "minilm-embed", "gpu", "torch-aot", "cuda", "acme/minilm-embed", "cu124-sm80")
    assert gpu.axes.to_json() == {"cuda": "12.4", "sm": "80", "torch": "2.6.0", "base": "cu"}
    assert list(gpu.axes.to_json()) == ["cuda", "sm", "torch", "base"]  # AXES order
    r = gpu.resolved
    assert (r.cuda, r.sm, r.torch, r.python, r.backend_version, r.runtime_source) == (
        "12.4", "80", "2.6.0", "3.11", "2.6.0", "pypi")
    assert r.base == BaseImage(name="cu", kind="image", ref="acme/cuda:12")
    assert r.require_cuda == compat.require_cuda_env("12.4")
    assert cpu.axes.to_json() == {"torch": "2.7.1", "base": "deb"} and cpu.device == "cpu"
    assert cpu.resolved.base == BaseImage(name="deb", kind="rootfs", ref="acme/base:deb")
    assert cpu.resolved.require_cuda is None and cpu.resolved.python == "3.11"


def test_json_of_a_plan(workdir):
    # cuda 12.5: torch 2.13's build is unconfirmed (a warning), torch 2.11 has none (picked past); sm 120
    # needs CUDA 12.8 (rejected). (Not CUDA 12.1: torch dropped that line after 2.5, compat.yaml cuda_drops.)
    plan = plan_of(workdir, ('cuda: ["12.4", "12.8"]', 'cuda: ["12.5"]'), ("sm: [80, 90]", "sm: [80, 120]"),
                   ('torch: ["2.6.0", "2.7.1"]', 'torch: ["2.11.0", "2.13.0", "2.7.1"]'))
    data = json.loads(json.dumps(plan.to_json()))
    v, cpu = plan.variants
    (r,) = plan.rejected
    assert v.warnings and v.warnings == plan.warnings and cpu.warnings == ()
    assert data == {
        "variants": [{"id": x.id, "image": "minilm-embed", "flavour": x.flavour, "backend": "torch-aot",
                      "device": x.device, "repository": "acme/minilm-embed", "tag": x.tag, "tags": [x.tag, x.long_tag],
                      "axes": x.axes.to_json(), "resolved": x.resolved.to_json(), "warnings": list(x.warnings)}
                     for x in (v, cpu)],
        "rejected": [{"id": "minilm-embed:cu125-sm120", "image": "minilm-embed", "flavour": "gpu",
                      "axes": {"cuda": "12.5", "sm": "120", "base": "cu"}, "reasons": list(r.reasons)}],
        "combinations": 3,
        "warnings": list(v.warnings),
    }
    assert (v.id, v.resolved.torch) == ("minilm-embed:cu125-sm80", "2.13.0")
    assert r.reasons and all("12.8" in reason or "120" in reason for reason in r.reasons)


def test_plan_warnings_sorted_and_unique(workdir):
    plan = plan_of(workdir, ('cuda: ["12.4", "12.8"]', 'cuda: ["12.5"]'),
                   ('torch: ["2.6.0", "2.7.1"]', 'torch: ["2.13.0", "2.7.1"]'))
    assert len(plan.variants) == 3 and all(v.warnings for v in plan.variants[:2])
    assert plan.warnings == tuple(sorted({w for v in plan.variants for w in v.warnings}))


def test_no_newest_value_fits(workdir):
    plan = plan_of(workdir, ('cuda: ["12.4", "12.8"]', 'cuda: ["12.1"]'),
                   ('torch: ["2.6.0", "2.7.1"]', 'torch: ["2.9.0", "2.11.0", "2.7.1"]'))
    assert [v.id for v in plan.variants] == ["minilm-embed:cpu"]
    candidates = ("2.11.0", "2.9.0", "2.7.1")  # newest first, by version
    why = dict.fromkeys(reason for t in candidates
                        for reason in compat.check(compat.Combo(cuda="12.1", sm="80", torch=t)).reasons)
    assert [(r.id, r.flavour, r.axes.to_json()) for r in plan.rejected] == [
        ("minilm-embed:cu121-sm80", "gpu", {"cuda": "12.1", "sm": "80", "base": "cu"}),
        ("minilm-embed:cu121-sm90", "gpu", {"cuda": "12.1", "sm": "90", "base": "cu"}),
    ]
    assert plan.rejected[0].reasons == (f"no torch in axes.torch ({', '.join(candidates)}) fits: " + " ".join(why),)


def test_rejected_id_when_the_tag_cannot_be_formed(workdir):
    """The tag needs the torch that could not be picked: the id names the axes instead."""
    plan = plan_of(workdir, ('cuda: ["12.4", "12.8"]', 'cuda: ["12.1"]'), ("sm: [80, 90]", "sm: [80]"),
                   ('torch: ["2.6.0", "2.7.1"]', 'torch: ["2.9.0", "2.7.1"]'),
                   ('tag: "cu{cuda_nodot}-sm{sm}"', 'tag: "cu{cuda_nodot}-sm{sm}-t{torch}"'))
    assert [r.id for r in plan.rejected] == ["minilm-embed:cuda12.1-sm80-basecu"]


def test_default_long_tag_names_every_version():
    values = {"cuda": "12.8", "tensorrt": "10.9.0", "tensorrt_llm": "1.0", "vllm": "0.11.0", "torch": "2.8.0",
              "python": "3.10", "driver": "570", "sm": "90", "base": "nv", "build_id": "7"}
    assert _default_long_tag("t", values) == "t-cuda12.8-trt10.9.0-trtllm1.0-vllm0.11.0-torch2.8.0-py3.10-drv570-b7"
    assert _default_long_tag("cpu", {"torch": "2.7.1", "cuda": None, "build_id": "1"}) == "cpu-torch2.7.1-b1"


def test_default_long_tag_in_a_plan(workdir):
    plan = plan_of(workdir, ("namespace: acme\n", "namespace: acme\nbuild_id: r2\n"),
                   ('  python: ["3.11"]\n', '  python: ["3.11"]\n  driver: ["570"]\n  vllm: ["0.32.0"]\n'
                                           '  torch: ["2.13.0"]\n'),
                   ('  torch: ["2.6.0", "2.7.1"]\n', ""),
                   (GPU_SET, "        set:\n          base: cu\n          python: '3.11'\n          driver: '570'\n"
                             "        tag: \"cu"),
                   ("cuda: [\"12.4\", \"12.8\"]", "cuda: [\"12.8\"]"), ("sm: [80, 90]", "sm: [90]"),
                   ('torch: "2.7.1"\n        tag: cpu\n', 'vllm: "0.32.0"\n          python: "3.11"\n'
                                                        '        tag: "cpu-t{torch}"\n'),
                   ("        backend: torch-aot\n        device: cpu", "        backend: vllm\n        device: cpu"))
    assert [(v.tag, v.long_tag) for v in plan.variants] == [
        ("cu128-sm90", "cu128-sm90-cuda12.8-torch2.13.0-py3.11-drv570-br2"),
        # vLLM's pin gives the torch: the tag may use it, and the long tag names it
        ("cpu-t2.13.0", "cpu-t2.13.0-vllm0.32.0-torch2.13.0-py3.11-br2"),
    ]


def test_tag_variables(workdir):
    plan = plan_of(workdir, ('torch: "2.7.1"\n        tag: cpu\n',
                             'torch: "2.7.1"\n          python: "3.11"\n'
                             '        tag: "{image}-{flavour}-{backend}-{device}-b{build_id}-py{python_nodot}-{base}"\n'
                             '        long_tag: "{flavour}-{torch}-{python}"\n'))
    cpu = plan.variants[-1]
    assert (cpu.tag, cpu.long_tag) == ("minilm-embed-cpu-torch-aot-cpu-b1-py311-deb", "cpu-2.7.1-3.11")


@pytest.mark.parametrize(("edits", "message"), [
    ((("tag: cpu\n", "tag: '-cpu'\n"),),
     f"{CPU}.tag: tag '-cpu' from template '-cpu' is not a valid Docker tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})"),
    ((("tag: cpu\n", "tag: cpu\n        long_tag: 'cpu+{torch}'\n"),),
     f"{CPU}.long_tag: tag 'cpu+2.7.1' from template 'cpu+{{torch}}' is not a valid Docker tag "
     "([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"),
    ((("tag: cpu\n", "tag: cpu-{cuda_nodot}\n"),),
     f"{CPU}.tag: tag template 'cpu-{{cuda_nodot}}' uses {{cuda_nodot}}, which this flavour does not have"),
    ((("tag: cpu\n", "tag: cpu\n        long_tag: 'cpu-{torch}-{cuda}'\n"),),
     f"{CPU}.long_tag: tag template 'cpu-{{torch}}-{{cuda}}' uses {{cuda}}, which this flavour does not have"),
    ((("tag: cpu\n", f"tag: {'c' * 120}\n"),),
     f"{CPU}: the default long tag '{'c' * 120}-torch2.7.1-b1' is too long; set long_tag"),
    # Two flavours, one tag: the second flavour's tag is named.
    ((("tag: cpu\n", "tag: cu124-sm80\n"),),
     f"{CPU}.tag: two variants would publish the same tag minilm-embed:cu124-sm80 (flavours gpu and cpu, axes "
     "{'cuda': '12.4', 'sm': '80', 'torch': '2.6.0', 'base': 'cu'} and {'torch': '2.7.1', 'base': 'deb'}); "
     "make the tag templates differ"),
    # A long tag counts too.
    ((("tag: cpu\n", "tag: cpu\n        long_tag: cu128-sm90\n"),),
     f"{CPU}.tag: two variants would publish the same tag minilm-embed:cu128-sm90 (flavours gpu and cpu, axes "
     "{'cuda': '12.8', 'sm': '90', 'torch': '2.7.1', 'base': 'cu'} and {'torch': '2.7.1', 'base': 'deb'}); "
     "make the tag templates differ"),
])
def test_tag_errors(workdir, edits, message):
    assert plan_error(workdir, *edits) == message


def test_explicit_long_tag_may_be_long(workdir):
    plan = plan_of(workdir, ("tag: cpu\n", f"tag: {'c' * 120}\n        long_tag: '{'c' * 120}-b{{build_id}}'\n"))
    assert plan.variants[-1].long_tag == "c" * 120 + "-b1"


def test_image_base_refs_and_reasons(workdir):
    plan = plan_of(workdir, ("bases:\n", "bases:\n" + NV_BASE + "    has_cuda: true\n"
                                         "    cuda_tags: {'12.4': 12.4.1-runtime, '12.6': 12.6.3-runtime}\n"),
                   ("  base: [deb, cu]", "  base: [deb, cu, nv]"), ('  python: ["3.11"]', '  python: ["3.11", "3.10"]'),
                   (GPU_SET, "        set:\n          base: nv\n        tag: \"cu"),
                   ("          base: deb\n          torch", "          base: nv\n          torch"))
    assert [v.id for v in plan.variants] == ["minilm-embed:cu124-sm80", "minilm-embed:cu124-sm90"]
    assert plan.variants[0].resolved.base == BaseImage("nv", "image", "nvidia/cuda:12.4.1-runtime")
    assert plan.variants[0].resolved.python == "3.10"  # the base's
    assert [(r.id, r.reasons) for r in plan.rejected] == [
        ("minilm-embed:cu128-sm80", ("base nv has no image for CUDA 12.8 (cuda_tags: 12.4, 12.6)",)),
        ("minilm-embed:cu128-sm90", ("base nv has no image for CUDA 12.8 (cuda_tags: 12.4, 12.6)",)),
        ("minilm-embed:cpu", ("base nv has no image for CUDA None (cuda_tags: 12.4, 12.6)",
                              "base nv is a CUDA image; a cpu flavour needs a plain base")),
    ]


def test_backend_version_needed(workdir):
    plan = plan_of(workdir, ('          torch: "2.7.1"\n', ""))
    assert [(r.id, r.reasons) for r in plan.rejected] == [
        ("minilm-embed:cpu", ("backend torch-aot needs a torch version: cross, set or pick it",))]


def test_cuda_flavour_without_cuda_has_no_cuda_requirement(workdir):
    plan = plan_of(workdir, ("          cuda: all\n", ""), ('tag: "cu{cuda_nodot}-sm{sm}"', 'tag: "sm{sm}"'))
    gpu = plan.variants[0]
    assert gpu.id == "minilm-embed:sm80" and gpu.resolved.require_cuda is None and gpu.resolved.cuda is None


def test_exclude_then_include(workdir):
    plan = plan_of(workdir, ("        newest: [torch]\n",
                             "        newest: [torch]\n        exclude:\n          - {sm: 90}\n"
                             "        include:\n          - {cuda: '12.8', sm: 90}\n"
                             "          - {cuda: '12.4', sm: 80}\n"))
    assert [v.id for v in plan.variants] == ["minilm-embed:cu124-sm80", "minilm-embed:cu128-sm80",
                                             "minilm-embed:cu128-sm90", "minilm-embed:cpu"]
    assert plan.combinations == 4  # an include already present is not added twice
    assert plan.variants[2].axes.base == "cu"  # an included combination takes the fixed values


SIX = ("        tag: cpu\n", "        tag: cpu\n      cpu2:\n        backend: torch-aot\n        device: cpu\n"
                             "        set: {base: deb, torch: '2.7.1'}\n        tag: cpu2\n")
FIRST_SIX = ("minilm-embed:cu124-sm80, minilm-embed:cu124-sm86, minilm-embed:cu124-sm90, minilm-embed:cu128-sm80, "
             "minilm-embed:cu128-sm86, minilm-embed:cu128-sm90")


@pytest.mark.parametrize(("edits", "known"), [
    ((), "minilm-embed:cu124-sm80, minilm-embed:cu124-sm90, minilm-embed:cu128-sm80, minilm-embed:cu128-sm90, "
         "minilm-embed:cpu"),
    ((SIX,), "minilm-embed:cu124-sm80, minilm-embed:cu124-sm90, minilm-embed:cu128-sm80, minilm-embed:cu128-sm90, "
             "minilm-embed:cpu, minilm-embed:cpu2"),
    ((("sm: [80, 90]", "sm: [80, 86, 90]"),), FIRST_SIX + ", ..."),
])
def test_select_matching_nothing_shows_some_ids(workdir, edits, known):
    message = plan_error(workdir, *edits, select=("minilm-embed:*", "nothing:*"))
    assert message == f"--select 'nothing:*' matches no variant (variants look like: {known})"


def test_select_filters_variants_and_rejections(workdir):
    edits = (('cuda: ["12.4", "12.8"]', 'cuda: ["12.1", "12.8"]'), ("sm: [80, 90]", "sm: [80, 120]"))
    plan = plan_of(workdir, *edits, select=("*:cu12?-sm120", "*:cpu"))
    assert [v.id for v in plan.variants] == ["minilm-embed:cu128-sm120", "minilm-embed:cpu"]
    assert [r.id for r in plan.rejected] == ["minilm-embed:cu121-sm120"]
    assert plan.combinations == 5  # what was planned, before selecting
    only_rejected = plan_of(workdir, *edits, select=("*:cu121-sm120",))  # a pattern may match a rejection only
    assert only_rejected.variants == () and [r.id for r in only_rejected.rejected] == ["minilm-embed:cu121-sm120"]


# --------------------------------------------------------------------------- the precision axis
PRECISION_AXIS = ("  base: [deb, cu]\n", "  base: [deb, cu]\n  precision: [fp32, bf16, int8, fp8]\n")
CPU_PRECISIONS = (CPU_TAG, "        axes:\n          precision: [fp32, int8, bf16]\n        tag: cpu-{precision}\n")


def test_a_cpu_flavour_crosses_the_precisions_its_backend_takes_there(workdir):
    """Crossing precision: one variant per value, named by {precision} in the tag, the value in the variant's
    axes and its engine parameters; a precision the backend does not compile on the device is rejected with
    the backend's own list (torch-aot on cpu: fp32, int8)."""
    from builder.render import _context, engine_params

    plan = plan_of(workdir, PRECISION_AXIS, CPU_PRECISIONS, select=("minilm-embed:cpu-*",))
    assert [v.id for v in plan.variants] == ["minilm-embed:cpu-fp32", "minilm-embed:cpu-int8"]
    int8 = plan.variants[1]
    assert int8.axes.precision == "int8" and int8.axes.to_json()["precision"] == "int8"
    assert list(int8.axes.to_json())[-1] == "precision"  # AXES order: last
    (bf16,) = plan.rejected
    assert bf16.id == "minilm-embed:cpu-bf16"
    assert bf16.reasons == ("backend torch-aot compiles no bf16 engines on cpu (it takes fp32, int8)",)
    matrix = load_matrix(workdir / "matrix.yaml")
    assert engine_params(int8, _context(matrix, int8)).precision == "int8"
    fp32 = plan.variants[0]
    assert engine_params(fp32, _context(matrix, fp32)).precision == "fp32"


def test_without_the_axis_the_recipe_decides_and_is_checked_too(workdir):
    """No precision axis: the recipe's precision for the device (cpu_precision on cpu), held to the same
    rule: a recipe asking bf16 on cpu gets a rejected variant, not a failed build."""
    plan = plan_of(workdir, select=("minilm-embed:cpu",))
    assert [v.id for v in plan.variants] == ["minilm-embed:cpu"] and plan.variants[0].axes.precision is None
    recipe = workdir / "images" / "minilm-embed" / "image.yaml"
    recipe.write_text(recipe.read_text().replace("cpu_precision: fp32", "cpu_precision: bf16"))
    plan = make_plan(load_matrix(workdir / "matrix.yaml"), ("minilm-embed:cpu",))
    assert not plan.variants
    assert plan.rejected[0].reasons == ("backend torch-aot compiles no bf16 engines on cpu (it takes fp32, int8)",)


def test_fp8_needs_sm_89_from_the_knowledge_base():
    """The knowledge base's precisions table: fp8 from sm_89 (Ada) on, with its source; other precisions
    have no arch floor there."""
    message = compat.precision_problem("fp8", "80")
    assert message.startswith("fp8 engines need sm_89 or newer, not sm_80 (source: TRT-MATRIX")
    assert compat.precision_problem("fp8", "86") is not None
    assert compat.precision_problem("fp8", "89") is None and compat.precision_problem("fp8", "90") is None
    assert compat.precision_problem("fp8", "120") is None and compat.precision_problem("bf16", "75") is None
    kb = compat.knowledge_base()
    without = compat.KnowledgeBase(data={k: v for k, v in kb.data.items() if k != "precisions"}, path=kb.path)
    assert compat.precision_problem("fp8", "80", without) is None  # the table is optional: no floor then


def test_a_gpu_flavour_whose_backend_takes_fp8_is_rejected_below_sm_89(workdir):
    plan = plan_of(workdir, PRECISION_AXIS,
                   ("        backend: torch-aot\n        device: cuda\n",
                    "        backend: tensorrt\n        device: cuda\n"),
                   ("        axes:\n          cuda: all\n          sm: all\n",
                    "        axes:\n          cuda: all\n          sm: all\n          precision: [fp8]\n"),
                   ("        newest: [torch]\n", "        newest: [tensorrt, torch]\n"),
                   ('  torch: ["2.6.0", "2.7.1"]\n', '  torch: ["2.6.0", "2.7.1"]\n  tensorrt: ["10.9.0"]\n'),
                   select=("minilm-embed:cu*",))
    fp8_reasons = {r.id: r.reasons for r in plan.rejected}
    assert any("fp8 engines need sm_89 or newer, not sm_80" in " ".join(reasons)
               for rid, reasons in fp8_reasons.items() if "sm80" in rid), fp8_reasons
    assert not any("fp8" in " ".join(reasons) for rid, reasons in fp8_reasons.items() if "sm90" in rid)


def test_newest_cannot_pick_a_precision(workdir):
    text = edited(PLAN_MINI, PRECISION_AXIS, ("        newest: [torch]\n", "        newest: [torch, precision]\n"))
    with pytest.raises(ConfigError, match="newest: precision has no newest value; cross it") as err:
        load_matrix(write(workdir, text))
    # the error points at the list item that names precision: its line and its key path
    line = text.splitlines().index("        newest: [torch, precision]") + 1
    assert re.search(rf"matrix\.yaml:{line}: images\.[\w-]+\.flavours\.[\w-]+\.newest\[1\]: newest: precision",
                     err.value.message), err.value.message
