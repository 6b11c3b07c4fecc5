"""Merged projections (builder/runtime/merged.py): one linear layer doing the work of Qwen3's q/k/v or
gate/up layers computes what they did, in full precision and in fp8 (the fp8 layers run on the CPU here,
as in test_quantize.py). The merged attention forward, which needs the fused kernel, is checked in
test_fused_qk.py (Triton's interpreter)."""
import pytest
import torch

from builder.runtime import merged
from builder.runtime.quantize import Fp8Linear


def _linear(in_features: int, out_features: int, seed: int, bias: bool = True, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.bias.normal_() if bias else None
    return layer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bias", [True, False])
def test_a_merged_layer_gives_its_parts_outputs_side_by_side(bias):
    parts = [_linear(32, width, seed, bias) for seed, width in enumerate((48, 16, 24))]
    layer = merged.merge_linears(parts)
    assert (layer.in_features, layer.out_features) == (32, 88) and (layer.bias is None) == (not bias)
    x = torch.randn(5, 7, 32, dtype=torch.float64)
    want = torch.cat([part(x) for part in parts], dim=-1)
    assert torch.allclose(layer(x), want, rtol=1e-12, atol=1e-12)
    for got, part in zip(layer(x).split([48, 16, 24], dim=-1), parts, strict=True):  # and in the order given
        assert torch.allclose(got, part(x), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
def test_layers_that_do_not_share_an_input_or_form_are_not_merged():
    base = _linear(32, 16, 0)
    for other in (_linear(24, 16, 1), _linear(32, 16, 1, bias=False), _linear(32, 16, 1, dtype=torch.float32)):
        with pytest.raises(ValueError, match="share their input width, bias, dtype and device"):
            merged.merge_linears([base, other])
    bf16 = _linear(32, 16, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="merge before quantizing"):
        merged.merge_linears([bf16, Fp8Linear(_linear(32, 16, 3, dtype=torch.bfloat16))])


@pytest.mark.timeout(60)
def test_merged_then_fp8_computes_exactly_what_the_separate_fp8_layers_do():
    """Per-channel weight scales and one per-token scale of the shared input: the merged fp8 layer's columns
    are the separate fp8 layers' outputs, bit for bit."""
    parts = [_linear(64, width, seed, dtype=torch.bfloat16) for seed, width in enumerate((32, 16, 16))]
    layer = Fp8Linear(merged.merge_linears(parts))
    x = (torch.randn(9, 64) * 4).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 64)
    assert torch.equal(got, torch.cat([Fp8Linear(part)(x) for part in parts], dim=-1))


class _Mlp(torch.nn.Module):
    """Qwen3MLP's form (transformers names the class; merged.py goes by that name)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = _linear(16, 40, 0, bias=False), _linear(16, 40, 1, bias=False)
        self.down_proj = _linear(40, 16, 2, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_Mlp.__name__ = "Qwen3MLP"


@pytest.mark.timeout(60)
def test_every_qwen3_mlp_gets_one_gate_up_layer_and_computes_as_before():
    body = torch.nn.ModuleList([_Mlp(), _Mlp(), torch.nn.Linear(16, 16, dtype=torch.float64)])
    x = torch.randn(3, 16, dtype=torch.float64)
    want = [body[0](x), body[1](x)]
    # no attention layer has fused_qk's forward here, so none is merged
    assert merged.merge_projections(body) == {"qkv": 0, "gate_up": 2}
    for mlp, before in zip(body[:2], want, strict=True):
        assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
        assert mlp.gate_up_proj.out_features == 80 and mlp.gate_up_split == (40, 40)
        assert torch.allclose(mlp(x), before, rtol=1e-12, atol=1e-12)
    assert merged.merge_projections(body) == {"qkv": 0, "gate_up": 0}  # a second call finds nothing left


@pytest.mark.timeout(60)
def test_merging_is_on_unless_switched_off(monkeypatch):
    from builder.runtime.errors import UsageError

    monkeypatch.delenv(merged.ENV, raising=False)
    assert merged.wanted()
    for value, want in (("1", True), ("0", False)):
        monkeypatch.setenv(merged.ENV, value)
        assert merged.wanted() is want
    for value in ("yes", "false", "", " 0"):  # a typo is an error, not silently merged
        monkeypatch.setenv(merged.ENV, value)
        with pytest.raises(UsageError, match=f"MOPT_MERGED_PROJ must be 0 or 1, not {value!r}"):
            merged.wanted()


class _Attention(torch.nn.Module):
    """Qwen3Attention's projections (merged.py goes by the class name and by the fused forward)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = _linear(16, 32, 3, bias=False), _linear(16, 8, 4, bias=False)
        self.v_proj, self.o_proj = _linear(16, 8, 5, bias=False), _linear(32, 16, 6, bias=False)


_Attention.__name__ = "Qwen3Attention"


@pytest.mark.timeout(60)
def test_only_attention_layers_with_the_fused_forward_get_one_qkv_layer():
    """The fused forward (fused_qk.py) is what splits qkv_proj's output, so a layer without it keeps q/k/v."""
    import types

    from builder.runtime import fused_qk

    fused, other, plain = _Attention(), _Attention(), _Attention()
    for layer in (fused, other):
        layer.forward = types.MethodType(fused_qk._fused_forward, layer)
    x = torch.randn(4, 16, dtype=torch.float64)
    want = torch.cat([fused.q_proj(x), fused.k_proj(x), fused.v_proj(x)], dim=-1)
    assert merged.merge_projections(torch.nn.ModuleList([fused, plain, other])) == {"qkv": 2, "gate_up": 0}
    assert fused.qkv_split == (32, 8, 8) and not any(hasattr(fused, n) for n in ("q_proj", "k_proj", "v_proj"))
    assert torch.allclose(fused.qkv_proj(x), want, rtol=1e-12, atol=1e-12)
    assert type(fused.o_proj) is torch.nn.Linear and fused.o_proj.out_features == 16  # o_proj is not merged
    assert all(hasattr(plain, n) for n in ("q_proj", "k_proj", "v_proj")) and not hasattr(plain, "qkv_proj")


@pytest.mark.timeout(60)
def test_the_merged_layer_lives_where_its_parts_did():
    parts = [torch.nn.Linear(8, 4, device="meta", dtype=torch.float16) for _ in range(2)]
    layer = merged.merge_linears(parts)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert layer.bias.device.type == "meta"


@pytest.mark.timeout(60)
def test_the_switch_is_the_documented_variable():
    from pathlib import Path

    assert merged.ENV == "MOPT_MERGED_PROJ"
    docs = (Path(__file__).resolve().parents[2] / "docs" / "environment.yaml").read_text()
    assert "\nMOPT_MERGED_PROJ:\n" in docs
