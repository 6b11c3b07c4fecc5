"""The family table (builder/runtime/families.yaml) held against real transformers models: for every
family, a tiny random-weight model whose weights are scaled up (x SCALE: at transformers' default init a
tiny model gives nearly the same output with or without its windows or its position offset, so a test
there would prove nothing), run packed (every sequence in one stream) and padded, each sequence against
the model run alone, on lengths from 1 token to the engine's maximum and past every window. And the
opposite: with a family's difference removed (windows ignored, positions from 0), the same check fails,
so the test holds the behaviour it names."""
from __future__ import annotations

import pytest
import torch

from builder.runtime import packed as packed_module
from builder.runtime.errors import UsageError
from builder.runtime.families import families, family, model_family
from builder.runtime.packed import pack
from tests.unit.test_packed import modules, one_at_a_time

pytestmark = pytest.mark.timeout(300)

SCALE = 25.0
LENGTHS = (1, 2, 5, 8, 9, 17, 18, 33, 40, 63, 64)  # 1 token to max_seq_len (64), past each window (8, 16)
SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             max_position_embeddings=130)


def _configs():
    import transformers as t

    decoder = dict(SMALL, num_key_value_heads=2, num_hidden_layers=2, head_dim=8)
    return {
        "bert": ("cls", t.BertConfig(**SMALL, num_hidden_layers=2)),
        "roberta": ("mean", t.RobertaConfig(**SMALL, num_hidden_layers=2, pad_token_id=1)),
        "xlm-roberta": ("cls", t.XLMRobertaConfig(**SMALL, num_hidden_layers=2, pad_token_id=1)),
        "camembert": ("mean", t.CamembertConfig(**SMALL, num_hidden_layers=2, pad_token_id=1)),
        "distilbert": ("mean", t.DistilBertConfig(vocab_size=100, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                                  max_position_embeddings=130)),
        # local_attention 16: each token sees 8 positions either way in layers 1 and 2; layer 0 is global
        "modernbert": ("cls", t.ModernBertConfig(**SMALL, num_hidden_layers=3, local_attention=16,
                                                 global_attn_every_n_layers=3, pad_token_id=0)),
        "qwen2": ("last", t.Qwen2Config(**decoder, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1)),
        "qwen3": ("last", t.Qwen3Config(**decoder, use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1)),
        "llama": ("last", t.LlamaConfig(**decoder)),
        "mistral": ("last", t.MistralConfig(**decoder, sliding_window=8)),
    }


def save_scaled(config, dest) -> None:
    """A random-weight model of CONFIG (seed 0) with its linear layers scaled by SCALE, saved to DEST."""
    from transformers import AutoModel

    torch.manual_seed(0)
    model = AutoModel.from_config(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(SCALE)
    model.save_pretrained(dest)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    made = {}
    for name, (pooling, config) in _configs().items():
        out = tmp_path_factory.mktemp(name)
        save_scaled(config, out)
        made[name] = (out, pooling)
    return made


def _worst_cosine(model_dir, pooling: str) -> float:
    packed, padded = modules(model_dir, pooling)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in LENGTHS]
    with torch.no_grad():
        got = packed(*pack(seqs))
    want = one_at_a_time(padded, seqs)
    return float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min())


def test_every_supported_family_has_a_tiny_model_here():
    assert set(_configs()) == {name for name, f in families().items() if not f.packed_refused}


@pytest.mark.parametrize("name", sorted(_configs()))
def test_a_packed_call_of_every_family_matches_each_text_alone(name, family_models):
    model_dir, pooling = family_models[name]
    assert model_family(model_dir).model_type == name
    assert _worst_cosine(model_dir, pooling) >= 0.9999


@pytest.mark.parametrize("name", ["modernbert", "qwen2", "qwen3", "mistral"])
def test_ignoring_a_familys_windows_is_caught(name, family_models, monkeypatch):
    model_dir, pooling = family_models[name]
    monkeypatch.setattr(packed_module, "window_reach", lambda sliding_window: None)
    assert _worst_cosine(model_dir, pooling) < 0.99


@pytest.mark.parametrize("name", ["roberta", "xlm-roberta", "camembert"])
def test_numbering_positions_from_zero_is_caught(name, family_models, monkeypatch):
    model_dir, pooling = family_models[name]
    monkeypatch.setattr(packed_module, "first_position", lambda config: 0)
    assert _worst_cosine(model_dir, pooling) < 0.99


def test_an_unknown_or_unpackable_architecture_is_refused_with_the_reason(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_bigcode"}')
    with pytest.raises(UsageError, match=r"architecture 'gpt_bigcode' is not one mopt compiles \(supported: bert, "):
        model_family(tmp_path)
    with pytest.raises(UsageError, match="mpnet cannot be compiled packed: MPNet computes its attention"):
        family("mpnet", packed=True)
    assert family("MPNet").model_type == "mpnet" and family("xlm_roberta").positions == "after_padding_idx"
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(UsageError, match="config.json is missing or not a JSON object"):
        model_family(tmp_path)


@pytest.mark.parametrize("architecture, ok", [("qwen3", True), ("xlm-roberta", True), ("gpt_bigcode", False)])
def test_mopt_plan_refuses_a_recipes_unknown_architecture(architecture, ok, tmp_path):
    """model.architecture in a recipe is checked against the family table when the plan is made: exit 2,
    one line naming the file, the key and what is supported, before anything is downloaded or built."""
    from tests.unit.test_config_fuzz import REPO, setup_tree
    from tests.unit.test_hostile_config import run_mopt

    recipe = (REPO / "images" / "qwen3-embed" / "image.yaml").read_text()
    recipe = recipe.replace("  architecture: qwen3\n", f"  architecture: {architecture}\n", 1)
    assert f"architecture: {architecture}" in recipe
    setup_tree(tmp_path, (REPO / "matrix.yaml").read_text(), recipe)
    proc = run_mopt("plan", "--matrix", "matrix.yaml", cwd=tmp_path)
    if ok:
        assert proc.returncode == 0, proc.stderr
        return
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "image.yaml" in lines[0] and "model.architecture" in lines[0]
    assert "architecture 'gpt_bigcode' is not one mopt compiles (supported: bert, camembert, distilbert" in lines[0]


@pytest.fixture(scope="module")
def tiny_modernbert(tmp_path_factory):
    """A scaled tiny ModernBERT (window 16 in two of three layers) with the offline word-level tokenizer."""
    import transformers as t

    from builder.runtime.tiny_qwen3 import build_tokenizer

    out = tmp_path_factory.mktemp("modernbert-engine-model")
    save_scaled(t.ModernBertConfig(**dict(SMALL, vocab_size=128), num_hidden_layers=3, local_attention=16,
                                   global_attn_every_n_layers=3, pad_token_id=0), out)
    build_tokenizer().save(str(out / "tokenizer.json"))
    return out


def _compile_packed(model_dir, out):
    from builder.runtime.compiler import compile_engine
    from builder.runtime.params import EngineParams

    params = EngineParams(backend="torch-aot", device="cpu", max_batch=8, max_seq_len=64, pooling="cls",
                          input_form="packed", max_batch_tokens=512, model_dir=str(model_dir))
    return compile_engine(model_dir, out, params, min_cosine=0.999)


@pytest.mark.timeout(900)
def test_a_compiled_packed_modernbert_passes_the_gate_at_every_length(tiny_modernbert, tmp_path):
    from builder.runtime import fingerprint

    _compile_packed(tiny_modernbert, tmp_path / "out")
    classes = fingerprint.read(tmp_path / "out")["accuracy_by_length"]
    assert set(classes) == {"1-8", "9-32", "33-128"}  # 1 token to max_seq_len 64, past the window (8)
    assert all(c["min"] >= 0.999 for c in classes.values()), classes


@pytest.mark.timeout(900)
def test_a_packed_graph_without_its_windows_is_refused_by_the_gate(tiny_modernbert, tmp_path, monkeypatch):
    """The issue's case: short texts cannot tell the window apart, the gate's long ones do."""
    from builder.runtime.errors import CompileError

    monkeypatch.setattr(packed_module, "window_reach", lambda sliding_window: None)
    with pytest.raises(CompileError, match=r"below --min-cosine 0.999: refused") as refused:
        _compile_packed(tiny_modernbert, tmp_path / "out")
    assert refused.value.exit_code == 4
    assert "(worst: 33-128-token texts" in str(refused.value) or "(worst: 9-32-token texts" in str(refused.value)
    assert not (tmp_path / "out" / "engine.json").exists()
