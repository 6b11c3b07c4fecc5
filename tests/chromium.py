"""Headless Chromium (Debian's chromium, installed by scripts/setup.sh) for the tests of the
self-contained HTML pages (the release report, the bench page): render a page with a probe script of
the test's own and return the DOM as Chromium computed it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def dump_dom(page: str, probe: str, directory: Path) -> str:
    """PAGE with PROBE (a <script>...</script>) put before </body>, rendered; the DOM Chromium ended with."""
    path = directory / "page.html"
    path.write_text(page.replace("</body>", probe + "</body>"))
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={directory / 'profile'}", "--dump-dom", path.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.stdout.strip(), result.stderr[-800:]
    return result.stdout
