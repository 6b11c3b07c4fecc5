"""docs/cli.md is generated from the CLIs (scripts/cli_docs.py) and names every MOPT_* variable the code reads."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SCRIPT = REPO / "scripts" / "cli_docs.py"


def _module():
    spec = importlib.util.spec_from_file_location("cli_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_page_is_current():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    module = _module()
    stale = tmp_path / "cli.md"
    stale.write_text(module.render().replace("`--select`", "`--choose`", 1))
    monkeypatch.setattr(module, "OUT", stale)
    monkeypatch.setattr(module, "REPO", tmp_path)
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0 and module.main(["--check"]) == 0


def _variables_read() -> set[str]:
    found: set[str] = set()
    for root in ("builder", "templates", "scripts"):
        for path in (REPO / root).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".j2", ".sh") and "__pycache__" not in path.parts:
                found |= set(re.findall(r"\bMOPT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    return found


def test_every_mopt_variable_is_documented():
    page = (REPO / "docs" / "cli.md").read_text()
    documented = set(re.findall(r"`(MOPT_[A-Z0-9_]+)`", page))
    variables = _variables_read()
    assert len(variables) > 20  # the scan finds the code's variables at all
    missing = sorted(variables - documented)
    assert not missing, f"MOPT_* variables the code reads but docs/cli.md does not list: {missing}"


def test_serve_options_take_their_variable_and_a_bad_value_is_one_usage_error(monkeypatch, capsys):
    import pytest

    from builder.runtime.__main__ import build_parser

    monkeypatch.setenv("MOPT_PORT", "8123")
    monkeypatch.setenv("MOPT_MAX_WAIT_MS", "2.5")
    args = build_parser().parse_args(["serve", "--engine-dir", "/e"])
    assert (args.port, args.max_wait_ms, args.max_inputs) == (8123, 2.5, 2048)
    assert build_parser().parse_args(["serve", "--engine-dir", "/e", "--port", "9"]).port == 9  # the flag wins
    monkeypatch.setenv("MOPT_PORT", "eighty")
    build_parser().parse_args(["check", "--engine-dir", "/e"])  # other commands do not read it
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--engine-dir", "/e"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --port: 'eighty' is not a valid int (given as the option or by MOPT_PORT)" in err
