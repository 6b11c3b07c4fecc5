"""A tiny Qwen3-architecture checkpoint with an offline tokenizer, for tests without the Hub.

Deterministic: the same seed gives the same model.safetensors bytes. Follows Qwen3-Embedding's
conventions (<|endoftext|> appended, left padding, last-token pooling).
"""
from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<unk>")
# A small embedded corpus; every lower-cased word and punctuation mark becomes one token.
CORPUS = """
the a an of to in on for with and or but is are was were be been it this that these those
what which who how why when where query document search find answer question instruct
given web retrieve relevant passages model engine image gpu cpu cuda docker container build
compile serve test fast slow small large cat dog bird fish tree river mountain city car
paris france london capital weather rain sun snow hot cold blue green red yellow one two three
four five six seven eight nine ten hello world embedding vector text token sentence
. , ! ? : ; ' " - ( ) 0 1 2 3 4 5 6 7 8 9
"""


def build_tokenizer():
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    words = []
    for w in CORPUS.split():
        if w not in words:
            words.append(w)
    vocab = {t: i for i, t in enumerate([*SPECIALS, *words])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS])
    return tok


def make_tiny_qwen3(out: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3Model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(EOS)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3Model(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
        "unk_token": "<unk>", "padding_side": "left", "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    return out
