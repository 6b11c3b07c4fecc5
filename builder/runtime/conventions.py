"""What a model's own sentence-transformers files say about how to embed with it: pooling (the Pooling
module's config), normalisation (a Normalize module) and query prompts (config_sentence_transformers.json).

A CLS-pooled model compiled with the default mean pooling serves wrong vectors that look fine, so the
compile step takes pooling and normalisation from these files when the flags or params leave them
out, and refuses (exit 2) flags or params that contradict them unless --force-pooling says it is meant.
Torch-free."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import UsageError

# Pooling config keys, in sentence-transformers' precedence; max and mean-sqrt-len are not served.
_POOLING_KEYS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_lasttoken", "last"))
_UNSERVED_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class Conventions:
    pooling: str | None  # cls | mean | last, None: the files say nothing
    normalize: bool | None
    prompts: dict  # name -> prompt text (recorded: "query" is what prompt_name asks for)


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_conventions(model_dir: str | Path) -> Conventions:
    model_dir = Path(model_dir)
    modules = _json(model_dir / "modules.json")
    modules = modules if isinstance(modules, list) else []
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = None
    if "Pooling" in types:
        cfg = _json(model_dir / str(types["Pooling"].get("path", "")) / "config.json")
        if isinstance(cfg, dict):
            modes = [name for key, name in _POOLING_KEYS if cfg.get(key)]
            unserved = [key for key in _UNSERVED_KEYS if cfg.get(key)]
            if unserved or len(modes) > 1:
                raise UsageError(f"--model {model_dir}: its sentence-transformers pooling "
                                 f"({', '.join(unserved + modes)}) "
                                 "is not one mopt serves (one of cls, mean, last)")
            pooling = modes[0] if modes else None
    normalize = True if "Normalize" in types else (False if modules else None)
    st = _json(model_dir / "config_sentence_transformers.json")
    prompts = st.get("prompts") if isinstance(st, dict) and isinstance(st.get("prompts"), dict) else {}
    return Conventions(pooling, normalize, {k: v for k, v in prompts.items() if isinstance(v, str)})


def apply_conventions(params, model_dir: str | Path, given: set[str], force: bool = False):
    """PARAMS with pooling and normalize from the model's files where GIVEN (the fields set by flags or a
    params file) leaves them out; UsageError where a given value contradicts the files, unless FORCE."""
    conv = read_conventions(model_dir)
    changes = {}
    for name, theirs in (("pooling", conv.pooling), ("normalize", conv.normalize)):
        if theirs is None:
            continue
        ours = getattr(params, name)
        if name not in given:
            changes[name] = theirs
        elif ours != theirs and not force:
            shown = {True: "true", False: "false"}.get(ours, ours), {True: "true", False: "false"}.get(theirs, theirs)
            raise UsageError(f"{name} {shown[0]} contradicts the model's sentence-transformers files ({name} "
                             f"{shown[1]}, in {model_dir}): drop it to use the model's, or pass --force-pooling")
    return replace(params, **changes) if changes else params
