"""The accuracy gate's texts and its figures per length class.

A gate of a few short sentences passes an engine that is wrong past 16 tokens: a packed graph that
ignored ModernBERT's 128-token window scored 1.0 on them. So the compile step checks the engine on
texts of every length the engine takes: 1 token, then each power of two to max_seq_len, the maximum
itself, and just past and well past each attention window the model has (its config's
sliding_window, ModernBERT's local_attention), in several scripts (Latin, Cyrillic, Greek, CJK, Arabic,
digits and code), cut to exact token counts with the engine's own tokenizer. They go through the engine
in one mixed call, as the server forms them, and each is compared with the model run alone in fp32
(the reference). The figures per length class (min and mean cosine) go into engine.json and
reference.json; the smoke test checks the same texts on the served image. Torch-free."""
from __future__ import annotations

import json
import re
from pathlib import Path

# Several scripts, so byte-level and word-piece tokenizers both see multi-byte text and long words.
SOURCE = (
    "The quick brown fox jumps over the lazy dog while the committee reviews 42 proposals. "
    "Быстрая коричневая лиса прыгает через ленивую собаку, пока комитет обсуждает бюджет. "
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο στην αγορά της πόλης. "
    "敏捷的棕色狐狸跳过了懒惰的狗，委员会正在审查四十二份提案和明年的预算。 "
    "الثعلب البني السريع يقفز فوق الكلب الكسول بينما تراجع اللجنة الميزانية. "
    "def embed(texts): return [model(t) for t in texts if t]  # 3.14159 2026-12-04 "
)
# Upper edges of the length classes (tokens); a class is (previous edge, edge].
CLASS_EDGES = (8, 32, 128, 512, 2048, 8192, 32768)


def windows_of(config: dict) -> list[int]:
    """How far (tokens) the model's windowed layers reach, from its config.json."""
    reach = []
    if isinstance(config.get("sliding_window"), int) and config["sliding_window"] > 0:
        reach.append(config["sliding_window"])
    if isinstance(config.get("local_attention"), int) and config["local_attention"] > 0:  # ModernBERT's full window
        reach.append(config["local_attention"] // 2)
    return sorted(set(reach))


def target_lengths(max_seq_len: int, windows: list[int]) -> list[int]:
    """Token counts the gate covers: 1, the powers of two up to max_seq_len, max_seq_len, and for each
    window w: w + 2 (just past it) and 4 w (well past it), all within max_seq_len."""
    lengths = {1, max_seq_len}
    n = 2
    while n < max_seq_len:
        lengths.add(n)
        n *= 2
    for w in windows:
        lengths.update({w + 2, 4 * w})
    return sorted(n for n in lengths if 1 <= n <= max_seq_len)


def length_class(tokens: int) -> str:
    low = 1
    for edge in CLASS_EDGES:
        if tokens <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{CLASS_EDGES[-1]}"


def _units(text: str) -> list[str]:
    """Words, and CJK characters one by one (that script has no spaces to cut at)."""
    return re.findall(r"[\u3000-\u9fff\uff00-\uffef]|[^\s\u3000-\u9fff\uff00-\uffef]+", text)


def gate_texts(encoder, max_seq_len: int, windows: list[int], scripts: int = 3) -> list[str]:
    """Texts whose token counts (as ENCODER counts them, special tokens included) are the targets, or the
    nearest below where no cut lands exactly; each target once per script the text starts in."""
    units = _units(SOURCE)
    starts = [0, units.index("Быстрая"), units.index("敏")][:scripts]
    stream = units * (2 + max_seq_len // max(1, len(units) // 4))  # a unit is at most a few tokens

    def tokens(start: int, count: int) -> int:
        return len(encoder.encode([" ".join(stream[start:start + count])])[0])

    texts: list[str] = []
    for target in target_lengths(max_seq_len, windows):
        for start in starts:
            low, high = 1, target  # the most units whose text has at most target tokens (a unit >= 1 token)
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if tokens(start, mid) <= target else (low, mid - 1)
            text = " ".join(stream[start:start + low])
            if tokens(start, low) <= max_seq_len and text not in texts:
                texts.append(text)
    return texts


def per_class(tokens: list[int], cosines: list[float]) -> dict[str, dict]:
    """{class: {"texts", "min", "mean"}} in class order."""
    groups: dict[str, list[float]] = {}
    for n, c in sorted(zip(tokens, cosines, strict=True)):
        groups.setdefault(length_class(n), []).append(c)
    return {name: {"texts": len(v), "min": round(min(v), 6), "mean": round(sum(v) / len(v), 6)}
            for name, v in groups.items()}


def model_windows(model_dir: str | Path) -> list[int]:
    try:
        return windows_of(json.loads((Path(model_dir) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return []
