"""The release report: Markdown grid, JSON, and the self-contained HTML page rendered in headless
Chromium (Debian's chromium, installed by scripts/setup.sh) and inspected."""
import html
import json
import re

import pytest

from builder.report import ReleaseReport, VariantReport
from tests.chromium import CHROMIUM, dump_dom


def sample() -> ReleaseReport:
    report = ReleaseReport(started=1000.0, steps=["build", "test", "publish"], registry="127.0.0.1:5000/ci",
                           rejected=[{"id": "qwen3-embed:cu121-sm100", "reasons": ["sm_100 was added in CUDA 12.8"]}])
    report.variants = [
        VariantReport(id="qwen3-embed:cu128-sm86", image="qwen3-embed", flavour="aot", tag="cu128-sm86", long_tag="x",
                      cuda="12.8", sm="86", built=True, tested=True, published=True, size_bytes=2_500_000_000,
                      digest="sha256:" + "a" * 64, durations={"build": 100.0, "test": 9.5, "publish": 20.0},
                      build_work=True, size_budget_bytes=3_000_000_000,
                      layers=[{"size_bytes": 80_000_000, "created_by": "ADD rootfs.tar /"},
                              {"size_bytes": 2_000_000_000, "created_by": "RUN pip install torch `x`"},
                              {"size_bytes": 1_000, "created_by": "COPY params.json /"},
                              {"size_bytes": 90_000_000, "created_by": ""},
                              {"size_bytes": 400_000_000, "created_by": "COPY engine /opt/engine"}]),
        VariantReport(id="qwen3-embed:cu128-sm90", image="qwen3-embed", flavour="aot", tag="cu128-sm90", long_tag="y",
                      cuda="12.8", sm="90", built=True, failed_step="test",
                      reason="smoke test failed: <script>alert(1)</script> cosine 0.91 < 0.99"),
        VariantReport(id="qwen3-embed:cu130-sm90", image="qwen3-embed", flavour="aot", tag="cu130-sm90", long_tag="z",
                      cuda="13.0", sm="90", built=True, tested=True),
        VariantReport(id="minilm-embed:cpu", image="minilm-embed", flavour="cpu", tag="cpu", long_tag="w",
                      built=True),
    ]
    report.finished = 1200.0
    return report


def test_summary_and_json():
    report = sample()
    assert report.summary() == {"published": 1, "tested": 1, "built": 1, "failed": 1, "skipped": 0, "build_work": 1}
    data = json.loads(json.dumps(report.to_json()))
    assert [v["status"] for v in data["variants"]] == ["published", "failed", "tested", "built"]


def test_markdown_grid():
    text = sample().markdown()
    assert "| `qwen3-embed:cu128-sm90` | failed |" in text
    assert "| 12.8 | published | failed |" in text and "| 13.0 | n/a | tested |" in text
    assert "sm_100 was added in CUDA 12.8" in text
    # Size against the flavour's budget, and the three largest layers, largest first (backticks dropped).
    assert "| yes | yes | 2500 MB of 3000 | 100.0 |" in text
    assert ("- `qwen3-embed:cu128-sm86`: 2500 MB of 3000; 2000 MB `RUN pip install torch x`; "
            "400 MB `COPY engine /opt/engine`; 90 MB (no step recorded)\n") in text
    assert "| `minilm-embed:cpu` | built | yes (cached) | - | - | - |" in text  # no size known


def test_html_is_self_contained_and_escaped():
    page = sample().html()
    assert "<script>alert(1)</script>" not in page and html.escape("<script>alert(1)</script>") in page
    assert not re.search(r"""(src|href)=["']?https?:""", page)  # no external assets


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (bash scripts/setup.sh installs it)")
def test_html_renders_in_headless_chromium(tmp_path):
    page = sample().html()
    # The page has no scripts of its own; this probe records what Chromium actually computed.
    probe = """<script>
      for (const td of document.querySelectorAll('td.status')) {
        td.setAttribute('data-bg', getComputedStyle(td).backgroundColor);
        td.setAttribute('data-w', td.getBoundingClientRect().width > 0 ? 'visible' : 'hidden');
      }
      document.body.setAttribute('data-rendered', 'yes');
    </script>"""
    dom = dump_dom(page, probe, tmp_path)
    assert 'data-rendered="yes"' in dom
    colours = dict(re.findall(r'class="status (\w+)"[^>]*data-bg="([^"]+)"', dom))
    assert colours["published"] == "rgb(46, 160, 67)"
    assert colours["failed"] == "rgb(215, 58, 73)"
    assert colours["tested"] == "rgb(154, 205, 50)"
    assert colours["absent"] == "rgb(230, 230, 230)"
    assert 'data-w="hidden"' not in dom
    assert "cosine 0.91 &lt; 0.99" in dom and "<script>alert(1)" not in dom
    assert dom.count("<tr data-id=") == 4
