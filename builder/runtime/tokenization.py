"""Tokenization shared by compile (reference texts) and the server, from tokenizer.json alone.

Conventions follow the pooling: last-token pooling (Qwen3-Embedding style) appends the
end-of-text token to every input and pads on the left (on the right with causal attention, see
causal_attention.py); mean/cls pooling pads on the right.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer

# Files copied into the engine dir so serving never needs the model dir.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class Batch:
    input_ids: list[list[int]]
    attention_mask: list[list[int]]


def cut(seq, n: int, direction: str):
    """The first n items of seq ("right": a cut on the right keeps the start) or the last n ("left")."""
    return seq[:n] if direction == "right" else seq[len(seq) - n:]


class TextEncoder:
    def __init__(self, directory: str | Path, pooling: str, instruction: str | None = None,
                 pad_left: bool | None = None):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (a fast tokenizer.json is required)")
        self.tok = Tokenizer.from_file(str(path))
        # Padding is ours; truncation is per call (encode's max_tokens), on the Encoding, never on
        # the shared Tokenizer: request threads encode concurrently and its settings are shared state.
        self.tok.no_truncation()
        self.tok.no_padding()
        self.num_special = self.tok.num_special_tokens_to_add(False)
        # Ids without character offsets (tokenizers >= 0.21): a third less time a text, on the server's
        # event loop among others; /tokenize, which returns offsets, uses encode_batch.
        self._ids_batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        cfg = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
        self.instruction = instruction
        # Where a cut to k tokens falls for vLLM's truncate_prompt_tokens (HF's default: right).
        self.truncation_side = "left" if cfg.get("truncation_side") == "left" else "right"
        # Engine params decide (EngineParams.pad_left); by default last-token pooling pads left.
        self.pad_left = pooling == "last" if pad_left is None else pad_left
        self.append_eos = pooling == "last"
        self.eos_id = self._find_id([_token_text(cfg.get("eos_token")), *EOS_CANDIDATES])
        if self.append_eos and self.eos_id is None:
            raise ValueError("last-token pooling needs an end-of-text token; none found in tokenizer")
        pad = self._find_id([_token_text(cfg.get("pad_token")), "[PAD]", "<pad>"])
        self.pad_id = pad if pad is not None else (self.eos_id or 0)
        # Whether we append EOS ourselves (the tokenizer's post-processor may add it already).
        probe = self.tok.encode("a").ids
        self._adds_eos = self.append_eos and (not probe or probe[-1] != self.eos_id)
        # Tokens every input gets besides its text's: the special tokens and the EOS we append.
        self._added = self.num_special + (1 if self._adds_eos else 0)

    def _find_id(self, candidates) -> int | None:
        for text in candidates:
            if text:
                tid = self.tok.token_to_id(text)
                if tid is not None:
                    return tid
        return None

    @property
    def query_prefix(self) -> str:
        # Qwen3-Embedding's query format; documents are embedded without an instruction.
        return f"Instruct: {self.instruction}\nQuery:" if self.instruction else ""

    def format_query(self, text: str) -> str:
        return self.query_prefix + text

    def encode(self, texts: list[str], max_tokens: int | None = None, direction: str = "right",
               keep_prefix: str = "", known: dict[str, list[int]] | None = None) -> list[list[int]]:
        """Token ids per text. max_tokens: truncate each to at most that many tokens, special tokens
        and the appended EOS included; direction 'right' keeps the start, 'left' keeps the end.
        keep_prefix: every text starts with it (the query instruction) and a left cut keeps it: the
        cut is taken from what follows it (it took the instruction first). known: encode()'s own
        answers for some texts (untruncated), computed earlier (tokenbatch.py): those are not encoded again."""
        if known and max_tokens is None:
            missing = [t for t in texts if t not in known]
            if missing:
                known = {**known, **dict(zip(missing, self.encode(missing), strict=True))}
            return [list(known[t]) for t in texts]  # copies: a request's lists are its own
        if keep_prefix and max_tokens is not None and direction == "left":
            return self._encode_keeping(texts, max_tokens, keep_prefix)
        if max_tokens is None:
            encodings = self._ids_batch(list(texts))
        elif max_tokens < self._added:
            # The special tokens alone do not fit: transformers' truncation gives up (it warns and keeps
            # every token) and vLLM then cuts that whole encoding to max_tokens on the side; so do we.
            return [cut(ids, max_tokens, direction) for ids in self.encode(texts)]
        else:
            # The tokenizers library's truncation, on each Encoding: cut the text's tokens to what is
            # left after the special tokens, then add those (so [CLS] .. [SEP] survive a cut).
            room = max_tokens - self._added
            encodings = []
            for enc in self._ids_batch(list(texts), add_special_tokens=False):
                enc.truncate(room, direction=direction)
                encodings.append(self.tok.post_process(enc))
        out = []
        for enc in encodings:
            ids = list(enc.ids)
            if self.append_eos and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)  # after truncation: it counts in max_tokens (room above)
            out.append(ids)
        return out

    def tokens(self, texts: list[str], add_special_tokens: bool = True) -> list[list[tuple]]:
        """Per text, its tokens as the engine sees them (the appended end-of-text too): (id, token text,
        special, start, stop), start/stop the token's character offsets in the text (None for a special
        token, as TEI's /tokenize)."""
        out = []
        for enc in self.tok.encode_batch(list(texts), add_special_tokens=add_special_tokens):
            rows = [(tid, token, bool(special), None if special else start, None if special else stop)
                    for tid, token, special, (start, stop) in zip(enc.ids, enc.tokens, enc.special_tokens_mask,
                                                                  enc.offsets, strict=True)]
            if add_special_tokens and self.append_eos and (not rows or rows[-1][0] != self.eos_id):
                rows.append((self.eos_id, self.tok.id_to_token(self.eos_id), True, None, None))
            out.append(rows)
        return out

    def decode(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.tok.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    def _encode_keeping(self, texts: list[str], max_tokens: int, prefix: str) -> list[list[int]]:
        head = self.tok.encode(prefix, add_special_tokens=False)
        room = max(0, max_tokens - self._added - len(head.ids))
        out = []
        for body in self.tok.encode_batch([t[len(prefix):] for t in texts], add_special_tokens=False):
            body.truncate(room, direction="left")
            ids = list(self.tok.post_process(Encoding.merge([head, body], True)).ids)
            if self.append_eos and (not ids or ids[-1] != self.eos_id):
                ids.append(self.eos_id)
            out.append(ids)
        return out

    def pad(self, seqs: list[list[int]], length: int) -> Batch:
        ids, mask = [], []
        for s in seqs:
            n = length - len(s)
            if self.pad_left:
                ids.append([self.pad_id] * n + s)
                mask.append([0] * n + [1] * len(s))
            else:
                ids.append(s + [self.pad_id] * n)
                mask.append([1] * len(s) + [0] * n)
        return Batch(ids, mask)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def copy_tokenizer_files(model_dir: str | Path, dest: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            (Path(dest) / name).write_bytes(src.read_bytes())
            copied.append(name)
    return copied
