"""Load YAML with line numbers and validate it against a JSON Schema.

Every error becomes one ConfigError naming the file, the key path and the line, so users never
see a traceback for a typo.
"""
from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from .errors import ConfigError

KeyPath = tuple[str | int, ...]
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def format_path(path: KeyPath) -> str:
    """('images', 'x', 'variants', 0) -> 'images.x.variants[0]'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.match(str(part)):
            out += ("." if out else "") + str(part)
        else:  # odd keys (spaces, newlines, dots) shown quoted, so the message stays one line
            out += f"[{str(part)!r}]"
    return out or "(top level)"


# libyaml's parser (PyYAML's C extension, in its wheels) where it is there: the pure-Python one took 85% of
# loading matrix.yaml and its recipes (155 ms, now 24 ms, in every mopt command). Both give the same events,
# nodes and marks; the constructors (what a tag means) are PyYAML's Python ones either way.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# Bounds on what a configuration file may hold. A real matrix.yaml is a few kilobytes, nests under
# ten levels and expands to a few thousand values; anchors and aliases can make a few lines expand
# exponentially ("billion laughs") and brackets can nest past Python's recursion limit.
MAX_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 100_000


def _compose(text: str, file: str, loader: type[yaml.SafeLoader]) -> yaml.Node | None:
    """Deep nesting refused from the event stream, before anything recursive reads the text; then the node
    graph. A YAMLError goes to the caller."""
    depth = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"nests deeper than {MAX_DEPTH} levels", file=file, line=event.start_mark.line + 1)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return yaml.compose(text, Loader=loader)


def _check_expansion(root: yaml.Node, file: str) -> None:
    """Refuse a document whose aliases make it expand past MAX_VALUES values or MAX_DEPTH levels, or
    refer to themselves. Counted over the node graph (each node once, iteratively), so the check
    itself costs what the file holds, not what it expands to."""
    size: dict[int, int] = {}  # values, the node's own included
    depth: dict[int, int] = {}  # collection levels, as _compose counts them (a scalar: 0)
    open_nodes: set[int] = set()  # started, not finished: an alias to one of them is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        collection = isinstance(node, (yaml.MappingNode, yaml.SequenceNode))
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if collection else []
        if children_done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0) if collection else 0
            if size[key] > MAX_VALUES:
                raise ConfigError(f"expands to more than {MAX_VALUES:,} values through anchors and aliases",
                                  file=file, line=node.start_mark.line + 1)
            if depth[key] > MAX_DEPTH:
                raise ConfigError(f"nests deeper than {MAX_DEPTH} levels through anchors and aliases",
                                  file=file, line=node.start_mark.line + 1)
        elif key not in size:  # a node two aliases name is counted once
            open_nodes.add(key)
            stack.append((node, True))
            for child in children:
                if id(child) in open_nodes:
                    raise ConfigError("an alias refers to the value that contains it (a recursive structure)",
                                      file=file, line=child.start_mark.line + 1)
                stack.append((child, False))


def _compose_positions(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            _compose_positions(value_node, path + (key,), lines)
            lines[path + (key,)] = key_node.start_mark.line + 1  # the key's line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _compose_positions(item, path + (index,), lines)


def _reject_duplicate_keys(node: yaml.Node, file: str) -> None:
    """Duplicate or non-scalar keys: PyYAML would silently keep the last one, or crash on hashing."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError("a mapping key must be a plain value, not a list or mapping", file=file,
                                  line=key_node.start_mark.line + 1)
            if key_node.value in seen:
                raise ConfigError(f"duplicate key {key_node.value!r}", file=file,
                                  line=key_node.start_mark.line + 1)
            seen.add(key_node.value)
            _reject_duplicate_keys(value_node, file)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(item, file)


class YamlDocument:
    """Parsed data plus the line of each key path, for error messages."""

    def __init__(self, data: Any, lines: dict[KeyPath, int], file: str):
        self.data, self.lines, self.file = data, lines, file

    def line_of(self, path: KeyPath) -> int | None:
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get(())

    def error(self, path: KeyPath, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, key=format_path(tuple(path)), line=self.line_of(path))


def _malformed(exc: Exception, file: str) -> ConfigError:
    """One line: PyYAML's problem without its multi-line context, and its line where it has one."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return ConfigError(f"malformed YAML: {problem}", file=file, line=mark.line + 1 if mark else None)


def compose_bounded(text: str, file: str) -> yaml.Node | None:
    """yaml.compose after the bounds checks (size, nesting, alias expansion): one ConfigError, quickly."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"larger than {MAX_BYTES // (1024 * 1024)} MiB", file=file)
    try:
        node = _compose(text, file, _LOADER)
    except yaml.YAMLError:
        # What libyaml refuses, PyYAML's pure-Python parser decides and words, as it always did: libyaml's
        # messages say less (an undefined alias without its name, its own depth limit before ours).
        try:
            node = _compose(text, file, yaml.SafeLoader)
        except yaml.YAMLError as exc:
            raise _malformed(exc, file) from None
    if node is not None:
        _check_expansion(node, file)
    return node


def safe_load_bounded(text: str, file: str) -> Any:
    """yaml.safe_load within the bounds (for files without a schema: compat.yaml, model cards); every
    failure, a tag it cannot construct included, is one ConfigError."""
    node = compose_bounded(text, file)
    return None if node is None else _construct(node, file)


def parse_json_bounded(text: str, file: str) -> Any:
    """json.loads within the same bounds: a size cap, and nesting past MAX_DEPTH refused (Python's
    parser would recurse to its limit and raise RecursionError)."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"larger than {MAX_BYTES // (1024 * 1024)} MiB", file=file)
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:  # brackets outside strings: the nesting, without recursion
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                raise ConfigError(f"nests deeper than {MAX_DEPTH} levels", file=file)
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=file) from None


def parse_yaml(text: str, file: str) -> YamlDocument:
    node = compose_bounded(text, file)
    if node is None:
        raise ConfigError("the file is empty", file=file)
    _reject_duplicate_keys(node, file)
    lines: dict[KeyPath, int] = {}
    _compose_positions(node, (), lines)
    return YamlDocument(_construct(node, file), lines, file)


def _construct(node: yaml.Node, file: str) -> Any:
    """The values of the composed (and checked) document: the text is not parsed a second time."""
    try:
        return yaml.constructor.SafeConstructor().construct_document(node)
    except (yaml.YAMLError, ValueError, TypeError) as exc:  # a tag it cannot construct: !foo, !!int abc
        raise _malformed(exc, file) from None
    except Exception as exc:  # noqa: BLE001 - PyYAML's constructors fail in other ways too (!!bool maybe)
        detail = " ".join(str(exc).split())  # one line, whatever the exception printed
        raise ConfigError(f"malformed YAML: a value its tag cannot hold ({type(exc).__name__}: {detail})",
                          file=file) from None


def load_yaml(path: Path | str, display: str | None = None) -> YamlDocument:
    path = Path(path)
    file = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", file=file) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", file=file) from None
    return parse_yaml(text, file)


@cache
def schema(name: str) -> dict:
    text = resources.files("builder").joinpath("schemas", f"{name}.schema.json").read_text("utf-8")
    return json.loads(text)


def _describe(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        names = ", ".join(repr(k) for k in extra)
        hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"unknown key {names}{hint}"
    if error.validator == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        hint = ""
        if isinstance(error.instance, float) and "string" in str(expected):
            hint = " (quote version numbers: 12.10 unquoted would read as 12.1)"
        return f"expected {expected}, got {type(error.instance).__name__} {error.instance!r}{hint}"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {', '.join(map(repr, error.validator_value))}"
    if error.validator == "required":
        return error.message.replace("is a required property", "is required")
    if error.validator == "pattern":
        return f"{error.instance!r} does not match the expected form {error.validator_value}"
    return error.message


def validate(doc: YamlDocument, schema_name: str) -> None:
    """Raise one ConfigError for the most relevant schema violation."""
    validator = jsonschema.Draft202012Validator(schema(schema_name))
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc.data))
    if error is None:
        return
    # For anyOf/oneOf pick the deepest sub-error: it names the real key.
    while error.context:
        error = jsonschema.exceptions.best_match(error.context)
    path = tuple(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        if extra:
            path = path + (extra[0],)
    raise doc.error(path, _describe(error))
