"""Probe of the CUDA AOTInductor load crash (torch 2.11.0+cu130 on the H200 machine): where in native
code the load dies, and whether a variant of the package loads.

    PYTHONUNBUFFERED=1 python3 benchmarks/aoti_probe.py --out $OUT [--variants default,debug,embed]

For each variant of the AOTInductor options it compiles a 3-layer MLP to a CUDA .pt2 (in a child
process), then runs each load step in a fresh process with a SIGSEGV handler preloaded (built here
with the C compiler AOTInductor needs anyway) that prints the native stack as module+offset, which
is then symbolised with addr2line: (1) aoti_load_package, (2) dlopen of the package's .so alone,
(3) the C++ runner built directly from the extracted .so. Writes aoti_probe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

# name: AOTInductor options, environment of the compile and of the loads ({work} is the work dir),
# and the device. The environment ones test where the crash comes from: the toolchain's C++ runtime.
VARIANTS = {
    "default": {},
    # symbols and frame pointers in the generated .so, so its frames in the stack have names
    "debug": {"options": {"aot_inductor.debug_symbols": True, "aot_inductor.enable_frame_pointer": True}},
    "embed": {"options": {"aot_inductor.embed_kernel_binary": True}},
    "cpu": {"device": "cpu"},
    "cxx-gxx": {"compile_env": {"CXX": "g++"}},
    # the link adds libstdc++ explicitly (a C driver's link leaves it out)
    "link-stdcxx": {"compile_env": {"CXX": "{work}/cxx-link-stdcxx"}},
    # libstdc++ linked into the .so on purpose: reproduces the H200 machine's compiler
    "static-stdcxx": {"compile_env": {"CXX": "{work}/cxx-static-stdcxx"}},
    # the compiler's own libstdc++ loaded before anything else in the loading process
    "preload-stdcxx": {"load_env": {"LD_PRELOAD": "{stdcxx}"}, "package_of": "default"},
}

SEGV_HANDLER_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static void frame(const char *what, void *pc) {
    char line[1024];
    Dl_info info;
    int n;
    if (dladdr(pc, &info) && info.dli_fname) {
        n = snprintf(line, sizeof line, "%s %s+0x%lx %s\n", what, info.dli_fname,
                     (unsigned long)((char *)pc - (char *)info.dli_fbase),
                     info.dli_sname ? info.dli_sname : "?");
    } else {
        n = snprintf(line, sizeof line, "%s %p ?\n", what, pc);
    }
    write(2, line, n);
}

static void on_fault(int sig, siginfo_t *si, void *ctx) {
    char line[256];
    int n = snprintf(line, sizeof line, "PROBE-FAULT signal %d at address %p\n", sig, si->si_addr);
    write(2, line, n);
    frame("PROBE-PC", (void *)((ucontext_t *)ctx)->uc_mcontext.gregs[REG_RIP]);
    void *stack[64];
    int depth = backtrace(stack, 64);
    for (int i = 0; i < depth; i++) frame("PROBE-FRAME", stack[i]);
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
    sigaction(SIGILL, &sa, NULL);
    sigaction(SIGABRT, &sa, NULL);
}
"""

COMPILE = """
import json, sys, torch
import torch._inductor.cpp_builder as cpp_builder
_run = cpp_builder._run_compile_cmd
def _logged(cmd_line, cwd):  # the probe's record of every compiler command
    print("COMPILE-CMD", cmd_line, flush=True)
    return _run(cmd_line, cwd)
cpp_builder._run_compile_cmd = _logged
print("compiler", cpp_builder.get_cpp_compiler())
options = json.loads(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                            torch.nn.ReLU(), torch.nn.Linear(128, 16)).to(sys.argv[3]).eval()
x = torch.randn(8, 64, device=sys.argv[3])
with torch.no_grad():
    exported = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(exported, package_path=sys.argv[1],
                                                    inductor_configs=options)
    torch.save({"x": x.cpu(), "y": model(x).cpu()}, sys.argv[1] + ".io")
print("compiled", path)
"""

LOAD_STEPS = {
    "load_package": """
import sys, torch
io = torch.load(sys.argv[1] + ".io")
runner = torch._inductor.aoti_load_package(sys.argv[1])
print("loaded")
print("libstdc++ mapped:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l}))
y = runner(io["x"].to(sys.argv[4]))
print("max abs diff", (y.cpu() - io["y"]).abs().max().item())
""",
    "dlopen_so": """
import ctypes, sys, torch
print("dlopen", sys.argv[2])
ctypes.CDLL(sys.argv[2], mode=ctypes.RTLD_LOCAL)
print("dlopen ok")
""",
    "runner_direct": """
import sys, torch
if sys.argv[4] == "cuda":
    torch.cuda.init()
    runner = torch._C._aoti.AOTIModelContainerRunnerCuda(sys.argv[2], 1, "cuda", sys.argv[3])
else:
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(sys.argv[2], 1)
print("runner ok")
io = torch.load(sys.argv[1] + ".io")
print("max abs diff", (runner.run([io["x"].to(sys.argv[4])])[0].cpu() - io["y"]).abs().max().item())
""",
}


def run(cmd: list[str], env: dict, timeout: int = 600) -> dict:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        return {"rc": proc.returncode, "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-12000:]}
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "stdout": "", "stderr": ""}


def symbolise(stderr: str) -> list[str]:
    """module+offset frames -> 'function at file:line' for the frames addr2line can name."""
    out = []
    for m in re.finditer(r"^(PROBE-\w+) (\S+)\+0x([0-9a-f]+) (\S+)$", stderr, re.M):
        kind, module, offset, sym = m.groups()
        name = sym
        if shutil.which("addr2line") and Path(module).is_file():
            res = subprocess.run(["addr2line", "-f", "-C", "-e", module, hex(int(offset, 16) - (kind != "PROBE-PC"))],
                                 capture_output=True, text=True)
            name = " @ ".join(line.strip() for line in res.stdout.splitlines()[:2]) or sym
        out.append(f"{kind} {Path(module).name}+0x{offset} {name}")
    return out


FACTS = r"""
for t in gcc g++ cc c++ clang++; do printf '%s: ' $t; command -v $t || echo none; done
echo "CXX=${CXX-unset} CC=${CC-unset}"
g++ --version 2>&1 | head -1; cc --version 2>&1 | head -1
echo "g++ libstdc++: $(g++ -print-file-name=libstdc++.so.6 2>/dev/null)"
ls -l /usr/lib/x86_64-linux-gnu/libstdc++.so.6* 2>&1
strings /usr/lib/x86_64-linux-gnu/libstdc++.so.6 2>/dev/null | grep -E '^GLIBCXX_3\.4\.3[0-9]$' | tail -2
ls /usr/lib/gcc/x86_64-linux-gnu/ 2>&1
python3 -c 'import torch; print("libstdc++ after import torch:",
  sorted({l.split()[-1] for l in open("/proc/self/maps") if "stdc++" in l}))'
"""
# g++ with extra flags on a shared-library link (the probe's variants link-stdcxx, static-stdcxx)
CXX_LINK = """#!/bin/sh
case " $* " in *" -shared "*) exec g++ "$@" {flags} ;; esac
exec g++ "$@"
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "probe-out"))
    p.add_argument("--work", default="/tmp/mopt-aoti-probe")
    p.add_argument("--variants", default="default,debug")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of this script")
    args = p.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    handler = work / "segv_stack.so"
    built = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(handler), "-x", "c", "-", "-ldl"],
                           input=SEGV_HANDLER_C, capture_output=True, text=True)
    if built.returncode:
        print("could not build the fault handler:", built.stderr)
        return 1
    for name, flags in (("link-stdcxx", "-lstdc++"), ("static-stdcxx", "-static-libstdc++")):
        wrapper = work / f"cxx-{name}"
        wrapper.write_text(CXX_LINK.format(flags=flags))
        wrapper.chmod(0o755)
    facts = subprocess.run(["bash", "-c", FACTS], capture_output=True, text=True).stdout
    print(facts)
    stdcxx = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("g++") else ""
    import torch

    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "facts": facts,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "variants": {}}

    def expand(env: dict) -> dict:
        return {k: v.format(work=work, stdcxx=stdcxx) for k, v in env.items()}

    for name in [v for v in args.variants.split(",") if v]:
        spec = VARIANTS[name]
        options, device = spec.get("options", {}), spec.get("device", args.device)
        pkg = work / f"{spec.get('package_of', name)}.pt2"
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / f"cache-{name}"))
        entry: dict = {"spec": spec}
        if "package_of" in spec:  # the same package, loaded another way
            entry["compile"] = report["variants"][spec["package_of"]]["compile"]
        else:
            entry["compile"] = run([sys.executable, "-c", COMPILE, str(pkg), json.dumps(options), device],
                                   dict(env, **expand(spec.get("compile_env", {}))))
        print(f"[{name}] compile rc {entry['compile']['rc']}")
        for line in entry["compile"]["stdout"].splitlines():
            if line.startswith(("COMPILE-CMD", "compiler")) and (" -shared" in line or line.startswith("compiler")):
                print("   ", line[:3000])
        if entry["compile"]["rc"] != 0:
            print(entry["compile"]["stderr"][-3000:])
            report["variants"][name] = entry
            continue
        extract = work / f"{spec.get('package_of', name)}-x"
        with zipfile.ZipFile(pkg) as z:
            z.extractall(extract)
            entry["members"] = [f"{i.filename} {i.file_size}" for i in z.infolist()]
        so = next(iter(sorted(extract.rglob("*.so"))), None)
        entry["so"] = str(so)
        if so is not None:
            for tool in (["ldd", str(so)], ["readelf", "-d", str(so)]):
                if shutil.which(tool[0]):
                    entry[tool[0]] = subprocess.run(tool, capture_output=True, text=True).stdout[-3000:]
            needed = re.findall(r"\(NEEDED\).*\[(.*)\]", entry.get("readelf", ""))
            defined = subprocess.run(["bash", "-c", f"nm -D --defined-only {so} | c++filt | grep -c 'std::locale'"],
                                     capture_output=True, text=True).stdout.strip()
            print(f"    NEEDED {needed}; std::locale symbols defined in the .so: {defined}")
        load_env = dict(env, LD_PRELOAD=str(handler))
        for key, value in expand(spec.get("load_env", {})).items():
            load_env[key] = f"{value} {load_env[key]}" if key == "LD_PRELOAD" else value
        for step, code in LOAD_STEPS.items():
            if step != "load_package" and so is None:
                continue
            res = run([sys.executable, "-c", code, str(pkg), str(so), str(so.parent if so else extract), device],
                      load_env)
            res["native_stack"] = symbolise(res["stderr"])
            entry[step] = res
            print(f"[{name}] {step}: rc {res['rc']} {res['stdout'].strip()[-400:]}")
            for line in res["native_stack"][:8]:
                print("   ", line[:300])
            if res["rc"] != 0 and not res["native_stack"]:
                print(textwrap.indent(res["stderr"][-2000:], "    "))
        report["variants"][name] = entry
    (out / "aoti_probe.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
