"""What the torch-aot engine path loads on a GPU, package by package, against what the image pins.

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_libs_probe.py probe --out $OUT      (on the GPU machine)
    .venv/bin/python benchmarks/cuda_libs_probe.py compare benchmarks/results/cuda_libs_h200.json \
        --variant qwen3-embed:cu130-sm90-aot-debian                                 (here)

probe (the GPU machine, the runtime as a plain program): makes the tiny Qwen3 (seed 0), compiles its
torch-aot engine for cuda with `python -m builder.runtime compile`, starts `serve` on it as an image does
(PYTHONPROFILEIMPORTTIME=1), asks for embeddings (one text, then a batch of mixed lengths), and reads
every process of the server, its engine worker too: the shared objects mapped (/proc/PID/maps) and the
modules imported, each traced to the installed distribution whose files hold it. Writes cuda_libs.json.

compare (here): that file against the variant's entry in mopt.lock.json: which pinned packages the engine
path loaded, which it never touched (what a leaner image could leave out, were it safe), and what it
loaded that the lock does not pin. Prints a Markdown table (docs/cuda-from-pypi.md holds the result).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # builder.runtime, as `python -m` from the repository finds it
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S.*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _owners() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(absolute file path -> distribution, top-level import name -> distributions) of this interpreter."""
    from importlib import metadata

    files: dict[str, str] = {}
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"])
        for f in dist.files or ():
            files[os.path.realpath(dist.locate_file(f))] = name
    return files, {k: sorted({_norm(d) for d in v}) for k, v in metadata.packages_distributions().items()}


def _tree(root: int) -> list[int]:
    """ROOT and every descendant process."""
    parents: dict[int, list[int]] = defaultdict(list)
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            continue
        parents[ppid].append(int(status.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def _mapped(pids: list[int]) -> set[str]:
    libs = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and ".so" in parts[5] and parts[5].startswith("/"):
                libs.add(os.path.realpath(parts[5].removesuffix(" (deleted)")))
    return libs


def _post(url: str, texts: list[str]) -> int:
    body = json.dumps({"input": texts, "model": "x"}).encode()
    req = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return len(json.loads(resp.read())["data"])


def _hidden(names: list[str]) -> list[tuple[Path, Path]]:
    """Move each package's directory aside, as if it were not installed (put back by the caller)."""
    import importlib.util

    moved = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"--hide {name}: no such package here")
        src = Path(list(spec.submodule_search_locations)[0])
        dst = src.with_name(src.name + ".hidden-by-probe")
        src.rename(dst)
        moved.append((dst, src))
    return moved


def probe(out: Path, work: Path, port: int, hide: list[str]) -> dict:
    import torch

    from builder.runtime.tiny_qwen3 import make_tiny_qwen3

    work.mkdir(parents=True, exist_ok=True)
    model, engine = work / "tiny", work / "engine"
    if not (model / "config.json").is_file():
        make_tiny_qwen3(model, 0)
    env = {**os.environ, "CXX": "g++"}  # the images' compiler is the distribution's g++ (gpu_bench.py says why)
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "builder.runtime", "compile", "--model", str(model), "--out",
                        str(engine), "--backend", "torch-aot", "--device", "cuda", "--precision", "bf16",
                        "--max-batch", "8", "--max-seq-len", "64", "--pooling", "last", "--target-sm",
                        f"{torch.cuda.get_device_capability(0)[0]}{torch.cuda.get_device_capability(0)[1]}"],
                       cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:
        raise SystemExit(f"compile failed ({p.returncode}): {p.stderr[-3000:]}")
    compile_s = round(time.monotonic() - t, 1)
    log = work / "serve-imports.log"
    moved = _hidden(hide)  # after the compile, which needs them all: does serving?
    with log.open("w") as err:
        server = subprocess.Popen([sys.executable, "-m", "builder.runtime", "serve", "--engine-dir", str(engine),
                                   "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"serve exited {server.returncode}: {log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(url + "/ready", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("serve not ready after 300 s") from None
                time.sleep(0.3)
        answered = _post(url, ["hello world"]) + _post(url, ["a gpu inference image " * n for n in range(1, 9)])
        pids = _tree(server.pid)
        libs = _mapped(pids)
    finally:
        server.terminate()
        server.wait(timeout=60)
        for dst, src in moved:
            dst.rename(src)
    modules = {m.group(1).strip() for line in log.read_text().splitlines() if (m := IMPORT_LINE.match(line))}
    files, tops = _owners()
    by_dist: dict[str, list[str]] = defaultdict(list)
    system = []
    for lib in sorted(libs):
        dist = files.get(lib)
        if dist:
            by_dist[dist].append(os.path.basename(lib))
        else:
            system.append(lib)
    imported: dict[str, int] = defaultdict(int)
    for module in modules:
        for dist in tops.get(module.split(".")[0], []):
            imported[dist] += 1
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": sys.version.split()[0], "compile_s": compile_s, "embeddings_answered": answered,
              "processes": len(pids), "hidden_while_serving": hide,
              "libraries_by_distribution": dict(sorted(by_dist.items())),
              "libraries_outside_distributions": system,
              "modules_by_distribution": dict(sorted(imported.items()))}
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_libs.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def compare(result_path: Path, lock_path: Path, variant: str) -> str:
    result = json.loads(result_path.read_text())
    entries = [e for e in json.loads(lock_path.read_text())["runtimes"].values() if variant in e["variants"]]
    if not entries:
        raise SystemExit(f"{lock_path} has no entry for {variant}: run mopt lock --select {variant}")
    locked = {_norm(line.split("==")[0]): line.split("==")[1].split()[0] for line in entries[0]["python"]}
    loaded = set(result["libraries_by_distribution"]) | set(result["modules_by_distribution"])
    rows = ["| locked package | version | engine path on the GPU |", "| --- | --- | --- |"]
    for name in sorted(locked):
        libs = result["libraries_by_distribution"].get(name, [])
        mods = result["modules_by_distribution"].get(name, 0)
        what = ", ".join(filter(None, [f"{len(libs)} shared objects" if libs else "",
                                       f"{mods} modules" if mods else ""])) or "not loaded"
        rows.append(f"| {name} | {locked[name]} | {what} |")
    extra = sorted(loaded - set(locked))
    outside = ", ".join(os.path.basename(p) for p in result["libraries_outside_distributions"])
    rows += ["", f"Loaded but not in the lock (the GPU machine's own packages): {', '.join(extra) or 'none'}.",
             f"Libraries outside any package: {outside}."]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe")
    pr.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "probe-out")))
    pr.add_argument("--work", type=Path, default=Path("/tmp/mopt-cuda-libs"))
    pr.add_argument("--port", type=int, default=18080)
    pr.add_argument("--hide", action="append", default=[], metavar="PACKAGE",
                    help="serve with this package's directory moved aside, as if not installed (repeatable)")
    co = sub.add_parser("compare")
    co.add_argument("result", type=Path)
    co.add_argument("--lock", type=Path, default=REPO / "mopt.lock.json")
    co.add_argument("--variant", default="qwen3-embed:cu130-sm90-aot-debian")
    a = p.parse_args(argv)
    if a.command == "probe":
        print(json.dumps(probe(a.out, a.work, a.port, a.hide), indent=2))
    else:
        print(compare(a.result, a.lock, a.variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
