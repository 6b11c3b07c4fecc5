"""yamlio: key paths, line numbers, malformed YAML and schema messages, each as the user reads it."""
from __future__ import annotations

import jsonschema
import pytest

from builder import yamlio
from builder.errors import ConfigError
from builder.yamlio import format_path, load_yaml, parse_yaml, validate


@pytest.mark.parametrize(("path", "text"), [
    ((), "(top level)"),
    (("images",), "images"),
    (("images", "x", "variants", 0), "images.x.variants[0]"),
    ((0, "a"), "[0].a"),
    (("a", 2, 3), "a[2][3]"),
    (("a b",), "['a b']"),
    (("images", "x.y", "tag"), "images['x.y'].tag"),
    (("a", "line\nbreak"), "a['line\\nbreak']"),  # stays one line
    (("Ok_key-1", "b"), "Ok_key-1.b"),
])
def test_format_path(path, text):
    assert format_path(path) == text


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_yaml(text, "f.yaml")
    assert exc.value.exit_code == 2
    return exc.value.message


@pytest.mark.parametrize(("text", "message"), [
    ("version: 1\naxes: [unclosed\n", "f.yaml:3: malformed YAML: expected ',' or ']', but got '<stream end>'"),
    ("a: 1\nb: c: d\n", "f.yaml:2: malformed YAML: mapping values are not allowed here"),
    ("a: 1\nb: *nothing\n", "f.yaml:2: malformed YAML: found undefined alias 'nothing'"),
    # The reader's error has no mark and no `problem`: the first line of its text, no line number.
    ("a: \x01\n", "f.yaml: malformed YAML: unacceptable character #x0001: special characters are not allowed"),
    # Errors raised while constructing values (after composing worked): still one line, with the line.
    ("a: 1\nb: !foo x\n", "f.yaml:2: malformed YAML: could not determine a constructor for the tag '!foo'"),
    ("a: !!int abc\n", "f.yaml: malformed YAML: invalid literal for int() with base 10: 'abc'"),
    # Tags whose constructors fail with other exceptions: still one message, never a traceback.
    ("a: !!bool maybe\n", "f.yaml: malformed YAML: a value its tag cannot hold (KeyError: 'maybe')"),
    ("a: !!int\n", "f.yaml: malformed YAML: a value its tag cannot hold (IndexError: string index out of range)"),
    ('a: !!timestamp ""\n', "f.yaml: malformed YAML: a value its tag cannot hold (AttributeError: 'NoneType' "
                             "object has no attribute 'groupdict')"),
    ("", "f.yaml: the file is empty"),
    ("# only a comment\n", "f.yaml: the file is empty"),
    ("a:\n  b: 1\n  b: 2\n", "f.yaml:3: duplicate key 'b'"),
    ("a: {b: 1}\nc:\n  - 1\n  - {d: 2, d: 3}\n", "f.yaml:4: duplicate key 'd'"),  # inside a list item
    ("a:\n  x:\n    y: 1\n    y: 2\n", "f.yaml:4: duplicate key 'y'"),
    ("a: 1\n? [k]\n: 1\n", "f.yaml:2: a mapping key must be a plain value, not a list or mapping"),
    ("a:\n  - {b: 1}\n  - {[k]: 1}\n", "f.yaml:3: a mapping key must be a plain value, not a list or mapping"),
])
def test_parse_errors_are_one_line_with_file_and_line(text, message):
    assert error_of(text) == message


def test_lines_of_keys_items_and_the_root():
    doc = parse_yaml("# comment\n\nimages:\n  x:\n    tags:\n      - a\n\n      - b\n    name:\n      n\n", "f.yaml")
    assert doc.data == {"images": {"x": {"tags": ["a", "b"], "name": "n"}}}
    assert doc.lines[()] == 3  # the root mapping starts at its first key, after the comments
    assert doc.line_of(()) == 3
    assert doc.line_of(("images",)) == 3
    assert doc.line_of(("images", "x", "tags")) == 5
    assert doc.line_of(("images", "x", "tags", 1)) == 8  # a list item: its own line
    assert doc.line_of(("images", "x", "name")) == 9  # a key: the key's line, not its value's
    # A path the file does not have: the nearest ancestor it has.
    assert doc.line_of(("images", "x", "missing")) == 4
    assert doc.line_of(("images", "x", "tags", 7, "deeper")) == 5
    assert doc.line_of(("nothing", "here")) == 3


def test_error_names_file_key_and_line():
    doc = parse_yaml("a:\n  b:\n    - 1\n    - 2\n", "f.yaml")
    err = doc.error(("a", "b", 1), "bad value")
    assert isinstance(err, ConfigError)
    assert (err.message, err.file, err.key, err.line) == ("f.yaml:4: a.b[1]: bad value", "f.yaml", "a.b[1]", 4)


def test_load_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_yaml(tmp_path / "nope.yaml", display="images/nope/image.yaml")
    assert exc.value.message == "images/nope/image.yaml: file not found"
    with pytest.raises(ConfigError) as exc:
        load_yaml(tmp_path / "nope.yaml")
    assert exc.value.message == f"{tmp_path / 'nope.yaml'}: file not found"
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError) as exc:
        load_yaml(latin, display="latin.yaml")
    assert exc.value.message == ("latin.yaml: cannot read: 'utf-8' codec can't decode byte 0xe9 in position 9: "
                                 "invalid continuation byte")
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"^dir\.yaml: cannot read: \[Errno 21\] Is a directory"):
        load_yaml(tmp_path / "dir.yaml", display="dir.yaml")


def test_load_yaml_reads_utf8(tmp_path, ascii_locale):
    path = tmp_path / "u.yaml"
    path.write_bytes("name: café ☕\n".encode())
    doc = load_yaml(path, display="u.yaml")
    assert doc.data == {"name": "café ☕"} and doc.file == "u.yaml"


MATRIX_HEAD = 'version: 1\nnamespace: acme\naxes:\n  sm: [80, 90]\n'
IMAGES = "images:\n  x:\n    recipe: r.yaml\n    flavours:\n      f: {backend: vllm, device: cpu, tag: cpu}\n"
ALLOWED_TOP = "axes, bases, build_id, images, namespace, runners, version"


@pytest.mark.parametrize(("text", "message"), [
    # additionalProperties: every unknown key named, sorted, with the allowed ones; the path is the first.
    (MATRIX_HEAD + "zeta: 1\nalpha: 2\n" + IMAGES,
     f"m.yaml:6: alpha: unknown key 'alpha', 'zeta' (allowed: {ALLOWED_TOP})"),
    # type, with the quoting hint only for a float where a string is expected
    (MATRIX_HEAD.replace("sm: [80, 90]", "cuda: [12.1]") + IMAGES,
     "m.yaml:4: axes.cuda[0]: expected string, got float 12.1 (quote version numbers: 12.10 unquoted would "
     "read as 12.1)"),
    (MATRIX_HEAD.replace("acme", "5") + IMAGES, "m.yaml:2: namespace: expected string, got int 5"),
    (MATRIX_HEAD.replace("acme", "[a]") + IMAGES, "m.yaml:2: namespace: expected string, got list ['a']"),
    (MATRIX_HEAD + IMAGES.replace("recipe: r.yaml", "recipe: 1.5"),
     "m.yaml:7: images.x.recipe: expected string, got float 1.5 (quote version numbers: 12.10 unquoted would "
     "read as 12.1)"),
    (MATRIX_HEAD + "runners: []\n" + IMAGES, "m.yaml:5: runners: expected object, got list []"),
    # A mapping where a string belongs: the error is about the key holding it, not a key inside it.
    (MATRIX_HEAD.replace("namespace: acme", "namespace:\n  a: 1") + IMAGES,
     "m.yaml:2: namespace: expected string, got dict {'a': 1}"),
    (MATRIX_HEAD + IMAGES.replace("device: cpu", "device: gpu"),
     "m.yaml:9: images.x.flavours.f.device: 'gpu' is not one of 'cuda', 'cpu'"),
    (MATRIX_HEAD + IMAGES.replace(", tag: cpu", ""), "m.yaml:9: images.x.flavours.f: 'tag' is required"),
    (MATRIX_HEAD.replace("acme", "Acme") + IMAGES,
     "m.yaml:2: namespace: 'Acme' does not match the expected form "
     "^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$"),
    (MATRIX_HEAD.replace("version: 1", "version: 2") + IMAGES, "m.yaml:1: version: 1 was expected"),
    # oneOf (sm: integer or string) with equally good branches: the deepest error of the first branch.
    (MATRIX_HEAD.replace("[80, 90]", "[80, 8.5]") + IMAGES, "m.yaml:4: axes.sm[1]: expected integer, got float 8.5"),
    (MATRIX_HEAD.replace("[80, 90]", "[80, 5]") + IMAGES, "m.yaml:4: axes.sm[1]: 5 is less than the minimum of 10"),
])
def test_schema_messages(text, message):
    doc = parse_yaml(text, "m.yaml")
    with pytest.raises(ConfigError) as exc:
        validate(doc, "matrix")
    assert exc.value.message == message


def test_valid_document_passes():
    validate(parse_yaml(MATRIX_HEAD + IMAGES, "m.yaml"), "matrix")


def _describe(schema: dict, instance) -> str:
    return yamlio._describe(jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema)
                                                             .iter_errors(instance)))


@pytest.mark.parametrize(("schema", "instance", "message"), [
    # An object that allows no key at all: no empty "(allowed: )" hint.
    ({"type": "object", "additionalProperties": False}, {"b": 1, "a": 2}, "unknown key 'a', 'b'"),
    ({"type": "object", "properties": {"k": {}}, "additionalProperties": False}, {"z": 1},
     "unknown key 'z' (allowed: k)"),
    ({"type": ["string", "integer"]}, 1.5, "expected string or integer, got float 1.5 (quote version numbers: "
                                           "12.10 unquoted would read as 12.1)"),
    ({"type": ["integer", "null"]}, "x", "expected integer or null, got str 'x'"),
    ({"type": "integer"}, "7", "expected integer, got str '7'"),
    ({"enum": [1, "a"]}, 2, "2 is not one of 1, 'a'"),
    ({"required": ["a", "b"]}, {"a": 1}, "'b' is required"),
    ({"pattern": "^x+$"}, "y", "'y' does not match the expected form ^x+$"),
    ({"maxItems": 1}, [1, 2], "[1, 2] is too long"),
])
def test_describe(schema, instance, message):
    assert _describe(schema, instance) == message


def test_closed_object_without_properties_names_the_key(monkeypatch):
    """A schema object that allows no keys: the path still ends at the unknown key, no hint."""
    monkeypatch.setattr(yamlio, "schema", lambda name: {"type": "object", "properties": {
        "opts": {"type": "object", "additionalProperties": False}}})
    doc = parse_yaml("opts:\n  b: 1\n  a: 2\n", "o.yaml")
    with pytest.raises(ConfigError) as exc:
        validate(doc, "anything")
    assert exc.value.message == "o.yaml:3: opts.a: unknown key 'a', 'b'"


def test_yaml_is_parsed_by_libyaml_where_pyyaml_has_it():
    """The fast path: every mopt command loads matrix.yaml and its recipes (24 ms with libyaml, 155 ms with the
    pure-Python parser). PyYAML's wheels for this platform carry libyaml."""
    import yaml

    assert yaml.__with_libyaml__
    assert yamlio._LOADER is yaml.CSafeLoader


# The undefined alias above is one too: libyaml says "found undefined alias", without the name.
@pytest.mark.parametrize(("text", "message"), [
    # libyaml: its own "exceeded maximum nesting depth" past 1,000 flow levels, before ours
    ("a: " + "[" * 1200 + "]" * 1200 + "\n", f"f.yaml:1: nests deeper than {yamlio.MAX_DEPTH} levels"),
    # between the two limits libyaml parses, and the event stream's own count refuses it
    ("a: " + "[" * 80 + "]" * 80 + "\n", f"f.yaml:1: nests deeper than {yamlio.MAX_DEPTH} levels"),
])
def test_what_libyaml_refuses_is_worded_by_the_pure_python_parser(text, message):
    assert error_of(text) == message


def test_the_deepest_nesting_allowed_loads_and_one_more_level_is_refused():
    deepest = "a: " + "[" * (yamlio.MAX_DEPTH - 1) + "]" * (yamlio.MAX_DEPTH - 1) + "\n"  # the top mapping counts
    value = parse_yaml(deepest, "f.yaml").data["a"]
    for _ in range(yamlio.MAX_DEPTH - 2):
        (value,) = value
    assert value == []
    assert error_of("a: " + "[" * yamlio.MAX_DEPTH + "]" * yamlio.MAX_DEPTH + "\n") == \
        f"f.yaml:1: nests deeper than {yamlio.MAX_DEPTH} levels"


@pytest.mark.parametrize(("text", "value"), [("", None), ("# only a comment\n", None),
                                             ("a: [1, x]\n", {"a": [1, "x"]})])
def test_safe_load_bounded_gives_what_safe_load_gives(text, value):
    import yaml

    assert yamlio.safe_load_bounded(text, "f.yaml") == value == yaml.safe_load(text)
