import locale
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """The tests' state dirs go into a list of their own, not the host's (statelock.py): a test's
    throw-away dirs never reach the prune of a user's checkout."""
    if "MOPT_STATE_REGISTRY" not in os.environ:
        import tempfile

        os.environ["MOPT_STATE_REGISTRY"] = str(Path(tempfile.mkdtemp(prefix="mopt-test-states-")) / "state-dirs")


def pytest_collection_modifyitems(config, items):
    """MOPT_TESTS_FIRST (file paths, space-separated): those files' tests first, in that order, the rest as
    collected. scripts/test.sh names the unit tier's longest files, so that pytest-xdist (--dist loadfile
    --no-loadscope-reorder) starts them first and the run does not end on one of them alone."""
    first = os.environ.get("MOPT_TESTS_FIRST", "").split()
    if first:
        rank = {name: i for i, name in enumerate(first)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sums each file's setup, call and teardown times (pytest-xdist sends its workers' reports here too)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The time of each file, longest first: where a run's minutes go (scripts/test.sh lays its phases out
    by these), which --durations' single tests do not show."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per file (its tests' setup, call and teardown), longest first")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    for path, seconds in ranked[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    if len(ranked) > 15:
        terminalreporter.write_line(f"{sum(s for _, s in ranked[15:]):8.1f}s  the other {len(ranked) - 15} files")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A copy of the shipped matrix, recipes and templates that a test may edit."""
    for name in ("matrix.yaml", "images", "templates"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, tmp_path / name)
        else:
            shutil.copy(src, tmp_path / name)
    return tmp_path


def run_mopt(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess (exit codes and stderr as users see them)."""
    full_env = dict(os.environ, **(env or {}))
    full_env.pop("MOPT_MATRIX", None)
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def ascii_locale():
    """The host's locale says ASCII (as LANG=C does without Python's UTF-8 mode)."""
    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
