#!/usr/bin/env python3
"""Generate docs/cli.md from the CLIs' own definitions: the host `mopt` (click) and the in-image
`mopt_runtime` (argparse), every option with its default and environment variable, plus every other
environment variable mopt reads (docs/environment.yaml).

    .venv/bin/python scripts/cli_docs.py           # rewrite docs/cli.md
    .venv/bin/python scripts/cli_docs.py --check   # exit 1 if docs/cli.md is stale (a unit test runs this)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import click
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from builder.cli import cli  # noqa: E402
from builder.runtime.__main__ import ENV_VARS, build_parser  # noqa: E402

OUT = REPO / "docs" / "cli.md"
ENVIRONMENT = REPO / "docs" / "environment.yaml"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def environment() -> dict[str, dict]:
    return yaml.safe_load(ENVIRONMENT.read_text())


def env_for_flag(env: dict[str, dict], flag: str, where: tuple[str, ...]) -> list[str]:
    return [name for name, spec in env.items() if spec.get("flag") == flag and spec["where"] in where]


def _click_default(param: click.Parameter) -> str:
    default = param.default
    if default is None or default is getattr(click.core, "UNSET", None) or default == () or default is False:
        return ""
    return str(default)


def _click_flags(param: click.Option) -> str:
    names = list(param.opts)
    if param.secondary_opts:
        names += param.secondary_opts
    return ", ".join(f"`{n}`" for n in names)


def _click_value(param: click.Option) -> str:
    if param.is_flag:
        return ""
    if isinstance(param.type, click.Choice):
        return ", ".join(param.type.choices)
    return param.metavar or param.type.name.upper()


def _commands(group: click.Group, ctx: click.Context, prefix: str = "") -> list[tuple[str, click.Command]]:
    """Every command, a group's subcommands under "group sub" (mopt kb check)."""
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            out += _commands(command, click.Context(command, parent=ctx, info_name=name), f"{prefix}{name} ")
        else:
            out.append((prefix + name, command))
    return out


def host_section(env: dict[str, dict]) -> list[str]:
    ctx = click.Context(cli, info_name="mopt")
    lines = ["## Host: `mopt`", "", _cell(cli.help), "",
             "Run `mopt COMMAND --help` for the same text. Exit codes: 0 ok, 2 bad input, 3 incompatible "
             "combination, 4 build failed, 5 smoke test failed, 6 publish failed, 7 host problem, 8 verification "
             "failed (mopt verify), 9 package index offline or unusable (mopt kb check).", ""]
    for name, command in _commands(cli, ctx):
        lines += [f"### `mopt {name}`", "", _cell(command.help or ""), "",
                  "| option | value | default | environment | what it does |", "| --- | --- | --- | --- | --- |"]
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            envs = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            envs += env_for_flag(env, param.opts[0], ("host",))
            lines.append(f"| {_click_flags(param)} | {_cell(_click_value(param))} | {_cell(_click_default(param))} "
                         f"| {', '.join(f'`{e}`' for e in envs)} | {_cell(param.help or '')} |")
        for param in command.params:
            if isinstance(param, click.Argument):
                lines.append(f"| `{param.name.upper()}` (argument) | | | | |")
        lines.append("")
    return lines


def _action_flags(action: argparse.Action) -> str:
    return ", ".join(f"`{o}`" for o in action.option_strings)


def _action_value(action: argparse.Action) -> str:
    if action.choices:
        return ", ".join(map(str, action.choices))
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return ""
    return action.metavar or (action.type.__name__.upper() if action.type else "TEXT")


def runtime_section(env: dict[str, dict]) -> list[str]:
    # Defaults as shipped: the variables that would change them are not read while documenting.
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in ENV_VARS.values() or k.startswith("MOPT_")}
    try:
        parser = build_parser()
    finally:
        os.environ.update(saved)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["## In the image: `python -m mopt_runtime`", "",
             _cell(parser.description or ""), "",
             "The same program runs outside Docker as `python -m builder.runtime`.", ""]
    for name, sub in subparsers.choices.items():
        lines += [f"### `mopt_runtime {name}`", "", _cell(sub.description or subparsers_help(subparsers, name)), "",
                  "| option | value | default | environment | what it does |", "| --- | --- | --- | --- | --- |"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            envs = [ENV_VARS[(name, action.option_strings[0])]] if (name, action.option_strings[0]) in ENV_VARS \
                else env_for_flag(env, action.option_strings[0], ("serve", "compile"))
            default = "" if action.default in (None, argparse.SUPPRESS) else str(action.default)
            required = " (required)" if action.required else ""
            lines.append(f"| {_action_flags(action)}{required} | {_cell(_action_value(action))} | {_cell(default)} "
                         f"| {', '.join(f'`{e}`' for e in envs)} | {_cell(action.help or '')} |")
        lines.append("")
    return lines


def subparsers_help(subparsers: argparse._SubParsersAction, name: str) -> str:
    return next((a.help for a in subparsers._choices_actions if a.dest == name), "") or ""


def environment_section(env: dict[str, dict]) -> list[str]:
    lines = ["## Environment variables", "",
             "Every variable mopt reads besides the options' own (listed with their options above).", "",
             "| variable | read by | option | what it does |", "| --- | --- | --- | --- |"]
    for name, spec in sorted(env.items()):
        flag = f"`{spec['flag']}`" if spec.get("flag") else ""
        lines.append(f"| `{name}` | {spec['where']} | {flag} | {_cell(spec['description'])} |")
    return lines + [""]


def render() -> str:
    env = environment()
    lines = ["# CLI reference", "",
             "Generated by `scripts/cli_docs.py` from the CLIs' own definitions; do not edit by hand "
             "(`tests/unit/test_cli_docs.py` fails when this page is stale).", ""]
    lines += host_section(env) + runtime_section(env) + environment_section(env)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from what would be written")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is stale: run .venv/bin/python scripts/cli_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
