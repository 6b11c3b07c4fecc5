"""TensorRT backend: what runs without TensorRT (profile, flags, error mapping, ONNX export on CPU),
and integration checks that run only where `import tensorrt` works."""
from __future__ import annotations

import types

import pytest

from builder.runtime.backends import get_backend
from builder.runtime.backends import tensorrt as trt_backend
from builder.runtime.errors import GuardError, UsageError
from builder.runtime.hostinfo import HostFacts
from builder.runtime.params import EngineParams

IMAGE = {"repository": "mopt/qwen3-embed", "tag": "cu128-sm90", "tag_template": "cu{cuda}-sm{sm}",
         "tags_by_sm": {"90": "cu128-sm90", "89": "cu128-sm89", "86": "cu128-sm86"}}
ENGINE_JSON = {"tensorrt": "10.9.0.34", "target_sm": "90", "image": IMAGE}


def facts(sm="89", tensorrt="10.14.1.48"):
    return HostFacts(torch="2.7.1+cu128", cuda="12.8", tensorrt=tensorrt, sm=sm, gpu_name="NVIDIA L4", driver="570")


def trt_params(**kw):
    base = dict(backend="tensorrt", device="cuda", precision="bf16", max_batch=64, max_seq_len=512, pooling="last")
    return EngineParams(**{**base, **kw})


def test_registered():
    assert get_backend("tensorrt") is trt_backend


def test_profile_from_params():
    p = trt_params(trt_min_batch=1, trt_opt_batch=16, trt_min_seq_len=2, trt_opt_seq_len=128)
    shapes = trt_backend.profile_shapes(p)
    assert set(shapes) == {"input_ids", "attention_mask"}
    assert shapes["input_ids"] == ((1, 2), (16, 128), (64, 512))


def test_profile_opt_defaults_to_max():
    assert trt_backend.profile_shapes(trt_params())["attention_mask"][1] == (64, 512)


@pytest.mark.parametrize("kw", [dict(trt_opt_batch=128), dict(trt_min_seq_len=600), dict(trt_min_batch=0)])
def test_profile_rejects_unordered(kw):
    with pytest.raises(ValueError, match="min_.* <= opt_.* <= max_"):
        trt_backend.profile_shapes(trt_params(**kw))


@pytest.mark.parametrize("precision,flags", [("fp32", ()), ("fp16", ("FP16",)), ("bf16", ("BF16",)),
                                             ("int8", ("INT8", "FP16")), ("fp8", ("FP8", "FP16"))])
def test_precision_flags(precision, flags):
    assert trt_backend.precision_flags(precision) == flags


def _fake_trt(levels=("NONE", "AMPERE_PLUS", "SAME_COMPUTE_CAPABILITY")):
    flag = types.SimpleNamespace(FP16="f16", BF16="bf16", INT8="i8", FP8="f8", VERSION_COMPATIBLE="vc")
    hw = types.SimpleNamespace(**{name: name.lower() for name in levels})
    return types.SimpleNamespace(BuilderFlag=flag, HardwareCompatibilityLevel=hw, __version__="10.9.0")


def test_builder_flag_values_map_to_builderflag():
    fake = _fake_trt()
    assert trt_backend.builder_flag_values(fake, trt_params(precision="int8")) == ["i8", "f16"]
    assert trt_backend.builder_flag_values(fake, trt_params(precision="fp8", trt_version_compatible=True)) == [
        "f8", "f16", "vc"]


def test_builder_flag_missing_in_old_tensorrt():
    fake = _fake_trt()
    del fake.BuilderFlag.FP8
    with pytest.raises(RuntimeError, match="no BuilderFlag FP8"):
        trt_backend.builder_flag_values(fake, trt_params(precision="fp8"))


@pytest.mark.parametrize("option,level", [("none", "none"), ("ampere_plus", "ampere_plus"),
                                          ("same_compute_capability", "same_compute_capability")])
def test_hardware_compatibility_levels(option, level):
    assert trt_backend.hardware_level(_fake_trt(), trt_params(trt_hardware_compatibility=option)) == level


def test_same_compute_capability_needs_new_tensorrt():
    with pytest.raises(RuntimeError, match="10.9"):
        trt_backend.hardware_level(_fake_trt(("NONE", "AMPERE_PLUS")),
                                   trt_params(trt_hardware_compatibility="same_compute_capability"))


def test_params_validation():
    with pytest.raises(UsageError, match="hardware-compatibility"):
        trt_params(trt_hardware_compatibility="hopper")
    with pytest.raises(UsageError, match="opset"):
        trt_params(trt_opset=13)
    with pytest.raises(UsageError, match="is not one torch-aot takes"):
        EngineParams(backend="torch-aot", device="cuda", precision="int8")
    # Defaults keep every other backend's params as they were.
    assert EngineParams().trt_opset == 17 and EngineParams.from_dict({"backend": "torch-aot"}).precision == "fp32"


def test_map_library_version_error():
    text = ("6: The engine plan file is not compatible with this version of TensorRT, expecting library version "
            "10.14.1.48 got 10.9.0.34, please rebuild. 4: [runtime.cpp::deserializeCudaEngine::66] Error Code 4: "
            "Internal Error (Engine deserialization failed.)")
    err = trt_backend.map_error(text, ENGINE_JSON, facts())
    assert isinstance(err, GuardError) and err.exit_code == 3
    assert "TensorRT 10.9.0.34" in err.message and "10.14.1.48" in err.message
    assert err.message.endswith("pull mopt/qwen3-embed:cu128-sm89")


def test_map_incompatible_device_error():
    text = ("The engine plan file is generated on an incompatible device, expecting compute 9.0 got compute 8.9, "
            "please rebuild.")
    err = trt_backend.map_error(text, ENGINE_JSON, facts(sm="89"))
    assert "engine built for sm_90 but this host's GPU is sm_89" in err.message
    assert "pull mopt/qwen3-embed:cu128-sm89" in err.message
    # Without host facts, the numbers come from TensorRT's own text.
    bare = trt_backend.map_error(text, {"image": IMAGE})
    assert "sm_90" in bare.message and "sm_89" in bare.message and "cu128-sm89" in bare.message


def test_map_serialization_version_error():
    text = "Serialization assertion stdVersionRead == serializationVersion failed.Version tag does not match."
    err = trt_backend.map_error(text, ENGINE_JSON, facts(sm="90"))
    assert "TensorRT 10.9.0.34" in err.message and "serialization version" in err.message
    assert err.message.endswith("pull mopt/qwen3-embed:cu128-sm90")


def test_map_unknown_error():
    assert trt_backend.map_error("out of memory", ENGINE_JSON, facts()) is None


def test_version_without_tensorrt():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert trt_backend.version() == "not-installed"


def test_onnx_export_tiny_qwen3_dynamic_axes(tmp_path):
    onnx = pytest.importorskip("onnx", reason="onnx is not installed (pip install onnx: the test extra)")
    import numpy as np
    import torch
    from onnx.reference import ReferenceEvaluator

    from builder.runtime.backends.torch_common import build_module
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "model", 0)
    params = trt_params(device="cpu", precision="fp32", max_batch=8, max_seq_len=64, trt_opset=17,
                        model_dir=str(model))
    path = trt_backend.export_onnx(str(model), params, tmp_path / "model.onnx")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert proto.opset_import[0].version >= 17
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    assert dims == {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}
    assert proto.graph.output[0].name == "embedding"
    # Shapes other than the export example give the eager module's numbers (the axes are really dynamic).
    evaluator = ReferenceEvaluator(proto)
    module = build_module(str(model), params, torch.float32, "cpu")
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 5), (3, 37)):
        ids = rng.integers(1, 100, size=(batch, seq)).astype(np.int64)
        mask = np.ones_like(ids)
        if batch > 1:
            mask[1, :7] = 0  # left padding, as last-token pooling uses
        got = evaluator.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        with torch.no_grad():
            want = module(torch.tensor(ids), torch.tensor(mask)).numpy()
        assert got.shape == (batch, 64)
        assert np.abs(got - want).max() < 1e-4


# --- integration: only where TensorRT is importable (never on the build machines) ------------------

def test_build_and_load_engine_with_tensorrt(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not importable here: its PyPI package downloads the "
                                           "real wheels from NVIDIA's index, which is unreachable")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT is importable but there is no CUDA GPU to build an engine on")
    from builder.runtime.compiler import compile_engine
    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    model = make_tiny_qwen3(tmp_path / "model", 0)
    params = trt_params(precision="fp16", max_batch=4, max_seq_len=64, trt_opt_batch=2, trt_opt_seq_len=32,
                        model_dir=str(model))
    result = compile_engine(model, tmp_path / "out", params, reference_texts=["hello", "a longer text here"])
    assert result["engine_min_cosine"] > 0.99
    assert (tmp_path / "out" / "engine" / trt_backend.TIMING_CACHE).stat().st_size > 0
