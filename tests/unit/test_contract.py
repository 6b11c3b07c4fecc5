"""The one contract between the build host and the runtime (builder/runtime/params.py): the recipe
schema agrees with it, every planned variant's params.json is what the runtime accepts, the compile
step takes its parameters only from that file, and a file that is not the contract is refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.matrix import load_matrix
from builder.plan import make_plan
from builder.render import _context, engine_params, render_variant, runtime_digest
from builder.runtime import params as contract
from builder.runtime.errors import UsageError
from builder.runtime.params import EngineParams

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "builder" / "schemas" / "image.schema.json").read_text())


def test_the_recipe_schema_agrees_with_the_contract():
    engine = SCHEMA["properties"]["engine"]["properties"]
    assert sorted(SCHEMA["$defs"]["precision"]["enum"]) == sorted(contract.PRECISIONS)
    assert tuple(engine["attention"]["enum"]) == contract.ATTENTIONS
    assert tuple(engine["input"]["enum"]) == contract.INPUT_FORMS
    assert tuple(engine["compile_mode"]["enum"]) == contract.COMPILE_MODES
    assert tuple(SCHEMA["properties"]["embedding"]["properties"]["pooling"]["enum"]) == contract.POOLINGS
    assert (engine["max_batch"]["minimum"], engine["max_batch"]["maximum"]) == (1, contract.MAX_BATCH)
    assert (engine["max_seq_len"]["minimum"], engine["max_seq_len"]["maximum"]) == (contract.SEQ_BUCKET,
                                                                                    contract.MAX_SEQ_LEN)
    trt = engine["tensorrt"]["properties"]
    assert tuple(trt["hardware_compatibility"]["enum"]) == contract.HARDWARE_COMPATIBILITY


@pytest.fixture(scope="module")
def planned():
    matrix = load_matrix(REPO / "matrix.yaml")
    return matrix, make_plan(matrix).variants


def test_every_planned_variant_renders_params_the_runtime_accepts(planned):
    matrix, variants = planned
    digest = runtime_digest()
    for variant in variants:
        files = render_variant(matrix, variant, REPO / "templates", digest, tuple(variants)).files
        params = EngineParams.parse(json.loads(files[contract.PARAMS_FILE]))
        assert (params.backend, params.device) == (variant.backend, variant.device), variant.id
        assert "--max-batch" not in files["compile.sh"] and "--params /mopt/inputs/params.json" in files["compile.sh"]


def test_a_combination_the_runtime_refuses_stops_the_render(planned):
    matrix, variants = planned
    variant = next(v for v in variants if v.id == "minilm-embed:cpu")
    context = _context(matrix, variant)
    assert engine_params(variant, context).precision == "fp32"
    with pytest.raises(ConfigError, match="minilm-embed:cpu: the runtime refuses these engine parameters: "
                                          r"--precision bf16 is not one torch-aot takes on cpu \(fp32, int8\)"):
        engine_params(variant, {**context, "precision": "bf16"})


@pytest.mark.parametrize("data, message", [
    ([], "expected a JSON object"),
    ({"backend": "torch-aot", "max_batchs": 4}, "unknown engine parameters ['max_batchs']"),
    ({"max_batch": "8"}, "max_batch must be int, got '8'"),
    ({"max_batch": True}, "max_batch must be int, got True"),
    ({"normalize": 1}, "normalize must be bool, got 1"),
    ({"instruction": 5}, "instruction must be str | None, got 5"),
    ({"max_batch": 5000}, "--max-batch must be in 1..4096"),
])
def test_params_that_are_not_the_contract_are_refused(data, message):
    with pytest.raises(UsageError) as err:
        EngineParams.parse(data)
    assert message in err.value.message


def test_params_round_trip_and_none_is_allowed_where_the_field_says_so():
    params = EngineParams(max_batch=4, instruction=None, matryoshka_min_dim=None)
    assert EngineParams.parse(json.loads(json.dumps(params.to_dict()))) == params


def _compile(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(tmp_path),
                           "--out", str(tmp_path / "out"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_the_compile_step_takes_params_or_flags_never_both(tmp_path):
    params = tmp_path / "params.json"
    params.write_text(json.dumps({"max_batch": 4}))
    both = _compile(tmp_path, "--params", str(params), "--max-batch", "8", "--pooling", "cls")
    assert both.returncode == 2 and "--params holds the engine parameters: drop max_batch, pooling" in both.stderr
    params.write_text('{"max_batch": 4, "colour": "red"}')
    bad = _compile(tmp_path, "--params", str(params))
    assert bad.returncode == 2 and "unknown engine parameters ['colour']" in bad.stderr
    assert "Traceback" not in both.stderr + bad.stderr
    missing = _compile(tmp_path, "--params", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "cannot read engine parameters" in missing.stderr


def test_engine_params_take_each_recipe_field_and_the_contract_defaults(planned):
    """engine_params, field by field: the common fields; the inductor, packed and tensorrt groups only for
    the backends that take them; a tensorrt key the recipe leaves out takes the contract's default."""
    import dataclasses

    matrix, variants = planned
    variant = next(v for v in variants if v.id == "minilm-embed:cpu")
    context = _context(matrix, variant)
    engine = dataclasses.replace(context["engine"], max_batch=16, max_seq_len=64, attention="causal",
                                 compile_mode="max-autotune-no-cudagraphs", tensorrt={"opt_batch": 4, "opset": 18})
    base = {**context, "engine": engine, "precision": "fp32", "pooling": "cls", "normalize": False,
            "instruction": "Find: ", "matryoshka_min_dim": 8, "packed": None, "compile_options": ()}
    plain = engine_params(variant, base).to_dict()
    expected = EngineParams(backend=variant.backend, device="cpu", precision="fp32", max_batch=16, max_seq_len=64,
                            pooling="cls", normalize=False, instruction="Find: ", matryoshka_min_dim=8).to_dict()
    assert plain == expected  # no group: compile mode, attention, form and TensorRT stay the defaults
    inductor = engine_params(variant, {**base, "compile_options": ("inductor",)})
    assert (inductor.compile_mode, inductor.attention) == ("max-autotune-no-cudagraphs", "causal")
    packed = engine_params(variant, {**base, "packed": {"max_sequences": 48, "max_batch_tokens": 512}})
    assert (packed.input_form, packed.max_batch, packed.max_batch_tokens) == ("packed", 48, 512)
    trt = engine_params(variant, {**base, "compile_options": ("tensorrt",)}).to_dict()
    changed = {k: v for k, v in trt.items() if v != expected[k]}
    assert changed == {"trt_opt_batch": 4, "trt_opset": 18}


def test_forward_compat_is_rendered_only_for_a_cuda_variant_on_a_cuda_base(planned):
    """The plan resolves forward compatibility for every CUDA variant; only a base that carries CUDA
    (NVIDIA's) gets the cuda-compat package rendered."""
    import dataclasses

    matrix, variants = planned
    variant = next(v for v in variants if v.device == "cuda" and v.resolved.forward_compat
                   and matrix.bases[v.resolved.base.name].has_cuda)
    assert _context(matrix, variant)["forward_compat"] == variant.resolved.forward_compat
    plain = next(name for name, base in matrix.bases.items() if not base.has_cuda)
    other = dataclasses.replace(variant, resolved=dataclasses.replace(
        variant.resolved, base=dataclasses.replace(variant.resolved.base, name=plain)))
    assert _context(matrix, other)["forward_compat"] is None
