"""The state dir (`.mopt/` by default): one object owns every path under it, and the records kept there.

    render/<image>/<tag>/     the variant's rendered Dockerfiles, compile.sh and manifest
    contexts/                 build contexts, made and removed around each docker build
    engines/<key>/            compiled engines (engine/, engine.json, reference.json), by content key
    models/                   materialised model dirs, by digest
    logs/<image>/<tag>/       one log per stage
    variants/<image>/<tag>.json        the variant record: what the last build produced
    variants/<image>/<tag>.smoke.json  the smoke record: which image passed which checks
    bases/                    rootfs base states
    reports/                  release reports (latest.json, latest.md, latest.html, repro-*.json)
    registry/                 the demo's local registry
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .hashing import dump_json

SUBDIRS = ("render", "contexts", "engines", "models", "logs", "variants", "bases", "reports")


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    name: str
    key: str
    image: str  # the stage tag (mopt-stage/<stage>:<key>), or the engine dir for the compile stage
    image_id: str
    skipped: bool
    seconds: float


@dataclass(frozen=True, kw_only=True)
class ModelRecord:
    source: str  # the model inside the image
    digest: str
    dimension: int
    substituted: bool
    declared: str = ""  # the recipe's model, when source is a substitute for it
    why: str = ""


@dataclass(frozen=True, kw_only=True)
class VariantRecord:
    """What the last build of a variant produced (written last, atomically, by mopt build)."""

    id: str
    image_id: str
    references: tuple[str, ...]  # (short ref, long ref)
    engine_dir: Path
    engine_sha256: str
    model: ModelRecord
    stages: tuple[StageRecord, ...]
    size_bytes: int

    def stage(self, name: str) -> StageRecord:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.id}: no {name} stage in its record")

    def image_ids(self) -> set[str]:
        """The final image and every stage image this record names (what prune keeps)."""
        return {self.image_id, *(s.image_id for s in self.stages)} - {""}

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "image_id": self.image_id, "references": list(self.references),
                "engine_dir": str(self.engine_dir), "engine_sha256": self.engine_sha256,
                "model": {"source": self.model.source, "digest": self.model.digest,
                          "dimension": self.model.dimension, "substituted": self.model.substituted,
                          "declared": self.model.declared, "why": self.model.why},
                "stages": [{"name": s.name, "key": s.key, "image": s.image, "image_id": s.image_id,
                            "skipped": s.skipped, "seconds": s.seconds} for s in self.stages],
                "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VariantRecord:
        return cls(id=data["id"], image_id=data["image_id"], references=tuple(data["references"]),
                   engine_dir=Path(data["engine_dir"]), engine_sha256=data["engine_sha256"],
                   model=ModelRecord(**data["model"]),
                   stages=tuple(StageRecord(**s) for s in data["stages"]), size_bytes=data["size_bytes"])


@dataclass(frozen=True, kw_only=True)
class SmokeRecord:
    """The last smoke test of a variant's image: a pass counts only for this image id and these checks."""

    image_id: str
    key: str  # digest of the smoke spec (image, inputs, threshold, reference ...)
    passed: bool
    checks: dict[str, Any] = field(default_factory=dict)
    min_cosine: float = 0.0
    start_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"image_id": self.image_id, "key": self.key, "passed": self.passed, "checks": self.checks,
                "min_cosine": self.min_cosine, "start_seconds": self.start_seconds}


class StateDir:
    """Every path under one state dir. Variants are addressed by (image, tag)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"StateDir({str(self.root)!r})"

    def create(self) -> StateDir:
        for sub in SUBDIRS:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        return self

    # -- paths ------------------------------------------------------------------------------
    @property
    def contexts(self) -> Path:
        return self.root / "contexts"

    @property
    def engines(self) -> Path:
        return self.root / "engines"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def bases(self) -> Path:
        return self.root / "bases"

    @property
    def reports(self) -> Path:
        return self.root / "reports"

    @property
    def registry(self) -> Path:
        return self.root / "registry"

    def render_dir(self, image: str, tag: str) -> Path:
        return self.root / "render" / image / tag

    def engine_dir(self, key: str) -> Path:
        return self.engines / key[:32]

    def context(self, stage: str, key: str) -> Path:
        return self.contexts / f"{stage}-{key[:32]}"

    def log_file(self, image: str, tag: str, stage: str) -> Path:
        return self.root / "logs" / image / tag / f"{stage}.log"

    def record_path(self, image: str, tag: str) -> Path:
        return self.root / "variants" / image / f"{tag}.json"

    def smoke_path(self, image: str, tag: str) -> Path:
        return self.root / "variants" / image / f"{tag}.smoke.json"

    def repro_report(self, image: str, tag: str) -> Path:
        return self.reports / f"repro-{image}-{tag}.json"

    # -- records ----------------------------------------------------------------------------
    def read_record(self, image: str, tag: str) -> VariantRecord | None:
        path = self.record_path(image, tag)
        return _parse_record(path) if path.is_file() else None

    def write_record(self, image: str, tag: str, record: VariantRecord) -> Path:
        return _write_atomic(self.record_path(image, tag), dump_json(record.to_json()))

    def records(self) -> Iterator[tuple[Path, VariantRecord]]:
        """Every variant record of this state dir; an unreadable one is an error (it may name images in use)."""
        for path in sorted((self.root / "variants").glob("*/*.json")):
            if path.name.endswith(".smoke.json"):
                continue
            yield path, _parse_record(path)

    def read_smoke(self, image: str, tag: str) -> SmokeRecord | None:
        path = self.smoke_path(image, tag)
        if not path.is_file():
            return None
        try:
            return SmokeRecord(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None  # an unreadable smoke record only means: test again

    def write_smoke(self, image: str, tag: str, record: SmokeRecord) -> Path:
        return _write_atomic(self.smoke_path(image, tag), dump_json(record.to_json()))

    def smoke_passed(self, image: str, tag: str, record: VariantRecord) -> bool:
        """Whether exactly this image passed its last smoke test (publish and export rely on it)."""
        smoke = self.read_smoke(image, tag)
        return smoke is not None and smoke.passed and smoke.image_id == record.image_id


def _parse_record(path: Path) -> VariantRecord:
    try:
        return VariantRecord.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: unreadable variant record ({type(exc).__name__}: {exc}); "
                          "fix or delete it (mopt build writes it again)") from None


def _write_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a killed writer leaves the old file
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
