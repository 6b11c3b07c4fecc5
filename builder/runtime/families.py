"""The model families the runtime compiles (families.yaml): position numbering, attention, windows,
token types, and whether a packed engine can reproduce the model. Torch-free: `mopt plan` reads it to
refuse a recipe's unknown architecture before anything is built, the compile step before any weights
load."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import UsageError

FAMILIES_YAML = Path(__file__).with_name("families.yaml")
POSITIONS = ("zero", "after_padding_idx")
ATTENTIONS = ("bidirectional", "causal")
_KEYS = {"positions", "attention", "windows", "token_types", "packed"}


@dataclass(frozen=True)
class Family:
    model_type: str
    positions: str
    attention: str
    windows: bool
    token_types: bool
    packed_refused: str | None  # why a packed engine cannot reproduce it (None: it can)


def _parse(name: str, row) -> Family:
    where = f"{FAMILIES_YAML.name}: {name}"
    required = {"positions", "attention", "windows", "token_types"}
    if not isinstance(row, dict) or set(row) - _KEYS or not required <= set(row):
        raise ValueError(f"{where}: expected positions, attention, windows, token_types (and packed), got {row!r}")
    if row["positions"] not in POSITIONS or row["attention"] not in ATTENTIONS:
        raise ValueError(f"{where}: positions must be one of {POSITIONS}, attention one of {ATTENTIONS}")
    if type(row["windows"]) is not bool or type(row["token_types"]) is not bool:
        raise ValueError(f"{where}: windows and token_types must be true or false")
    refused = row.get("packed")
    if refused is not None and not (isinstance(refused, str) and refused.strip()):
        raise ValueError(f"{where}: packed must be the reason packed engines are refused")
    return Family(name, row["positions"], row["attention"], row["windows"], row["token_types"], refused)


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    import yaml

    doc = yaml.safe_load(FAMILIES_YAML.read_text())
    rows = doc.get("families") if isinstance(doc, dict) else None
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{FAMILIES_YAML.name}: expected a 'families' mapping")
    return {name: _parse(name, row) for name, row in rows.items()}


def normalize(model_type: str) -> str:
    return model_type.strip().lower().replace("_", "-")


def family(model_type: str, packed: bool = False, where: str = "the model") -> Family:
    """The family of a model_type; UsageError (exit 2) with the reason when it is not supported, or not
    in packed form when packed."""
    known = families()
    found = known.get(normalize(model_type)) if isinstance(model_type, str) else None
    if found is None:
        raise UsageError(f"{where}: architecture {model_type!r} is not one mopt compiles (supported: "
                         f"{', '.join(sorted(known))}; families.yaml lists what each needs)")
    if packed and found.packed_refused:
        raise UsageError(f"{where}: {found.model_type} cannot be compiled packed: {found.packed_refused}")
    return found


def model_family(model_dir: str | Path, packed: bool = False) -> Family:
    """The family of the model in MODEL_DIR (its config.json's model_type)."""
    config = Path(model_dir) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise UsageError(f"--model {model_dir}: config.json is missing or not a JSON object") from None
    return family(model_type, packed, where=f"--model {model_dir}")
