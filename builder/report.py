"""The release report: JSON for machines, a Markdown grid for people (and CI job summaries)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

STATUSES = ("published", "tested", "built", "failed", "skipped")


@dataclass
class VariantReport:
    id: str
    image: str
    flavour: str
    tag: str
    long_tag: str
    cuda: str = ""
    sm: str = ""
    built: bool = False
    tested: bool = False
    published: bool = False
    failed_step: str = ""
    reason: str = ""
    image_id: str = ""
    size_bytes: int = 0
    size_budget_bytes: int = 0  # 0: the flavour sets no budget
    layers: list = field(default_factory=list)  # {size_bytes, created_by}, bottom first
    digest: str = ""
    references: list = field(default_factory=list)
    durations: dict = field(default_factory=dict)  # step -> seconds
    build_work: bool = False  # False when every stage was already built
    smoke: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    substitute: str = ""  # the model inside when it is not the recipe's (tags end in -substitute)
    bench: dict = field(default_factory=dict)  # release --bench: builder/bench/run.py's release_bench

    @property
    def bench_text(self) -> str:
        """"21.4 req/s, p99 260 ms" from release --bench, "-" without one."""
        if not self.bench or "error" in self.bench:
            return "-" if not self.bench else "bench failed"
        p99 = self.bench.get("p99_ms")
        return f"{self.bench['requests_per_s']:.3g} req/s" + (f", p99 {p99:.0f} ms" if p99 is not None else "")

    @property
    def size_text(self) -> str:
        """"976 MB", or "976 MB of 1000" against the flavour's budget."""
        if not self.size_bytes:
            return "-"
        return f"{self.size_bytes / 1e6:.0f} MB" + (f" of {self.size_budget_bytes / 1e6:.0f}"
                                                       if self.size_budget_bytes else "")

    @property
    def status(self) -> str:
        if self.failed_step:
            return "failed"
        for status in ("published", "tested", "built"):
            if getattr(self, status):
                return status
        return "skipped"


def _cell(v: VariantReport) -> str:
    """A grid cell: the status, and the speed where release --bench measured it."""
    return v.status + (f" ({v.bench_text})" if v.bench and "error" not in v.bench else "")


@dataclass
class ReleaseReport:
    started: float
    steps: list
    registry: str = ""
    variants: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    finished: float = 0.0

    def to_json(self) -> dict:
        return {"started": self.started, "finished": self.finished, "steps": self.steps, "registry": self.registry,
                "summary": self.summary(), "variants": [asdict(v) | {"status": v.status} for v in self.variants],
                "rejected": self.rejected}

    def summary(self) -> dict:
        counts = {status: 0 for status in STATUSES}
        for v in self.variants:
            counts[v.status] += 1
        counts["build_work"] = sum(1 for v in self.variants if v.build_work)
        return counts

    def markdown(self) -> str:
        s = self.summary()
        lines = ["# mopt release report", "",
                 f"steps: {', '.join(self.steps)}" + (f" | registry: `{self.registry}`" if self.registry else ""),
                 f"variants: {len(self.variants)} | published {s['published']} | tested {s['tested']} | "
                 f"built {s['built']} | failed {s['failed']} | rebuilt {s['build_work']} | "
                 f"wall {self.finished - self.started:.1f} s", "",
                 "| variant | status | built | tested | published | size | build s | test s | publish s | bench | "
                 "reason |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        mark = {True: "yes", False: "-"}
        for v in self.variants:
            d = v.durations
            size = v.size_text
            built = mark[v.built] + ("" if v.build_work or not v.built else " (cached)")
            reason = v.reason.replace("|", "\\|").replace("\n", " ")[:200] if v.reason else ""
            lines.append(f"| `{v.id}` | {v.status} | {built} | {mark[v.tested]} | {mark[v.published]} | {size} | "
                         f"{d.get('build', '-')} | {d.get('test', '-')} | {d.get('publish', '-')} | {v.bench_text} | "
                         f"{reason} |")
        substitutes = [(v.id, v.substitute) for v in self.variants if v.substitute]
        if substitutes:
            lines += ["", "## substituted models (not the recipe's model; tagged -substitute)", ""]
            lines += [f"- `{vid}`: {' '.join(what.split())}" for vid, what in substitutes]
        sized = [v for v in self.variants if v.layers]
        if sized:
            lines += ["", "## image sizes (the three largest layers)", ""]
            lines += [f"- `{v.id}`: {v.size_text}; " + "; ".join(
                f"{layer['size_bytes'] / 1e6:.0f} MB " + (f"`{layer['created_by'][:70].replace('`', '')}`"
                                                          if layer["created_by"] else "(no step recorded)")
                for layer in sorted(v.layers, key=lambda layer: -layer["size_bytes"])[:3]) for v in sized]
        notes = [(v.id, note) for v in self.variants for note in v.notes]
        if notes:
            lines += ["", "## notes", ""] + [f"- `{vid}`: {note}" for vid, note in notes]
        for title, rows in self._grids().items():
            lines += ["", f"## {title}", "", rows]
        if self.rejected:
            lines += ["", f"## rejected by the plan ({len(self.rejected)})", ""]
            lines += [f"- `{r['id']}`: {' '.join(r['reasons'])}" for r in self.rejected]
        return "\n".join(lines) + "\n"

    def _grid_data(self) -> list[tuple[str, dict]]:
        """A CUDA x sm grid per image flavour, the way users look for their tag."""
        groups: dict = {}
        for v in self.variants:
            if v.cuda and v.sm:
                groups.setdefault((v.image, v.flavour), []).append(v)
        grids = []
        for (image, flavour), items in groups.items():
            cudas = sorted({v.cuda for v in items}, key=lambda c: tuple(map(int, c.split("."))))
            sms = sorted({v.sm for v in items}, key=lambda s: int("".join(ch for ch in s if ch.isdigit())))
            grids.append((f"{image} / {flavour}",
                          {"cudas": cudas, "sms": sms, "cells": {(v.cuda, v.sm): v for v in items}}))
        return grids

    def _grids(self) -> dict:
        grids = {}
        for title, grid in self._grid_data():
            sms, cells = grid["sms"], grid["cells"]
            rows = ["| cuda \\ sm | " + " | ".join(sms) + " |", "| --- |" + " --- |" * len(sms)]
            rows += [f"| {c} | " + " | ".join(_cell(cells[(c, s)]) if (c, s) in cells else "n/a" for s in sms) + " |"
                     for c in grid["cudas"]]
            grids[title] = "\n".join(rows)
        return grids

    def html(self) -> str:
        """A self-contained page (inline CSS, no scripts, no external assets)."""
        env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
        template = env.from_string(resources.files("builder").joinpath("data", "report.html.j2").read_text("utf-8"))
        return template.render(steps=self.steps, registry=self.registry, summary=self.summary(),
                               wall=self.finished - self.started, grids=self._grid_data(), variants=self.variants,
                               rejected=self.rejected)

    def write(self, directory: Path) -> tuple[Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started))
        json_path, md_path = directory / f"release-{stamp}.json", directory / f"release-{stamp}.md"
        json_path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        md_path.write_text(self.markdown())
        (directory / f"release-{stamp}.html").write_text(self.html())
        for suffix in ("json", "md", "html"):
            (directory / f"latest.{suffix}").write_text((directory / f"release-{stamp}.{suffix}").read_text())
        return json_path, md_path
