"""A bench result as people and machines read it: a Markdown table, bench.json, and the chart of p99
latency against throughput per target, as a PNG and inside a self-contained HTML page (inline CSS
and SVG, no scripts, no external assets). The chart is drawn by matplotlib (Agg: no display)."""
from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import jinja2

from .load import Run
from .run import BenchResult, TargetResult

FILES = ("bench.json", "bench.md", "bench.png", "bench.html")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(name: str, run: Run) -> str:
    tps = run.tokens_per_s
    errors = ", ".join(f"{kind} {n}" for kind, n in sorted(run.errors.items())) or "0"
    return (f"| {name} | {run.label} | {run.ok} | {run.requests_per_s:.2f} | "
            f"{'-' if tps is None else f'{tps:.0f}'} | {_ms(run.percentile(50))} | {_ms(run.percentile(90))} | "
            f"{_ms(run.percentile(99))} | {_ms(run.percentile(100))} | {errors} |")


def markdown(result: BenchResult) -> str:
    w = result.workload
    lines = ["# mopt bench", "",
             f"workload: lengths {w['lengths']} words (drawn: min {w['words']['min']}, median {w['words']['median']}, "
             f"max {w['words']['max']}), {w['batch']} texts per request, seed {w['seed']}, sha256 {w['sha256'][:12]}",
             f"each run: {result.settings.duration_s:g} s or {result.settings.max_requests} requests", "",
             "| target | run | answered | req/s | tokens/s | p50 ms | p90 ms | p99 ms | max ms | errors |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in result.targets:
        lines += [_row(t.target.name, run) for run in t.points()]
        if t.error:
            lines.append(f"| {t.target.name} | failed | - | - | - | - | - | - | - | {t.error.replace('|', '/')} |")
    sweeps = [t for t in result.targets if t.sweep]
    if sweeps:
        target_ms = sweeps[0].sweep.p99_target_ms
        lines += ["", f"highest rate with p99 <= {target_ms:g} ms (sweep):", ""]
        lines += [f"- {t.target.name}: {t.sweep.answer:.3g} req/s (peak {t.sweep.peak_rate:.3g}, "
                  f"{len(t.sweep.steps)} steps)" for t in sweeps]
    warnings = [(t.target.name, w) for t in result.targets for w in t.warnings]
    if warnings:
        lines += ["", "warnings:", ""] + [f"- {name}: {w}" for name, w in warnings]
    return "\n".join(lines) + "\n"


def chart(result: BenchResult, fmt: str) -> bytes:
    """p99 latency (ms) against answered requests/s per target: its open-loop runs (the sweep's too) as
    one line, its closed-loop runs as another, in the target's colour; FMT png or svg."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False}):  # a '$' in a name or path is text, not TeX
        return _chart(result, fmt)


def _chart(result: BenchResult, fmt: str) -> bytes:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=110)
    axes = figure.subplots()
    for index, t in enumerate(result.targets):
        colour = f"C{index % 10}"
        for mode, style, marker, suffix in (("open", "-", "o", "open loop"), ("closed", "--", "s", "closed loop")):
            runs = sorted((run for run in t.points() if run.ok and run.mode == mode), key=lambda run: run.level)
            points = [(run.requests_per_s, run.percentile(99)) for run in runs]  # in the order of the load offered
            if points:
                axes.plot([x for x, _ in points], [y for _, y in points], linestyle=style, marker=marker,
                          color=colour, fillstyle="full" if mode == "open" else "none",
                          label=f"{t.target.name} ({suffix})")
    sweeps = [t.sweep for t in result.targets if t.sweep]
    if sweeps:
        axes.axhline(sweeps[0].p99_target_ms, linestyle="--", color="grey", linewidth=1,
                     label=f"p99 target {sweeps[0].p99_target_ms:g} ms")
    w = result.workload
    axes.set_title(f"p99 latency against throughput: {w['lengths']} words, {w['batch']} texts per request",
                   fontsize=10)
    axes.set_xlabel("answered requests/s")
    axes.set_ylabel("p99 latency (ms)")
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="best", fontsize=9)
    out = io.BytesIO()
    figure.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else {"Software": None})
    return out.getvalue()


def html(result: BenchResult) -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(resources.files("builder").joinpath("data", "bench.html.j2").read_text("utf-8"))
    svg = chart(result, "svg").decode()
    svg = svg[svg.index("<svg"):]  # the XML prolog and doctype do not belong inside HTML
    rows: list[tuple[TargetResult, Run | None]] = []
    for t in result.targets:
        rows += [(t, run) for run in t.points()] + ([(t, None)] if t.error else [])
    return template.render(result=result, data=result.to_json(), rows=rows, chart=svg)


def write(result: BenchResult, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in FILES]
    paths[0].write_text(json.dumps(result.to_json(), indent=2) + "\n")
    paths[1].write_text(markdown(result))
    paths[2].write_bytes(chart(result, "png"))
    paths[3].write_text(html(result))
    return paths
