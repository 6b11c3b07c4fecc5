"""builder.versions: dotted versions, the KB range notation, sm / cc / cuda / driver normalisation."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from builder.errors import ConfigError
from builder.versions import (
    cc_to_sm,
    compare_versions,
    in_any,
    major_minor,
    normalize_cuda,
    normalize_driver,
    normalize_sm,
    parse_range,
    parse_version,
    release,
    sm_to_cc,
)


@pytest.mark.parametrize("a,b,expected", [
    ("12.1", "12.10", -1),
    ("10.13.2", "10.13.0", 1),
    ("580.65.06", "580.65.6", 0),
    ("570.26", "570.124.06", -1),
    ("2.11.0", "2.9.1", 1),
    ("2.13.0+cpu", "2.13.0", 0),      # the local part is ignored
    ("2.8.0a0", "2.8.0", -1),
])
def test_compare_versions(a, b, expected):
    assert compare_versions(a, b) == expected


def test_parse_version_and_release():
    assert release("580.65.06") == (580, 65, 6)
    assert release("2.13.0+cpu") == (2, 13, 0)
    assert parse_version("2.13.0+cpu").local == "cpu"
    assert major_minor("12.8.1") == "12.8"
    assert major_minor("12") == "12.0"


@pytest.mark.parametrize("bad", ["", "abc", "1..2", None, [1], "1.٣"])
def test_parse_version_rejects_junk_with_config_error(bad):
    with pytest.raises(ConfigError):
        parse_version(bad)


@pytest.mark.parametrize("rng,version,inside", [
    ("12.1", "12.1", True),
    ("12.1", "12.1.1", True),
    ("12.1", "12.10", False),
    ("12.0-12.8", "12.0", True),
    ("12.0-12.8", "12.8.1", True),      # upper bound by prefix
    ("12.0-12.8", "12.9", False),
    ("12.0-12.8", "11.8", False),
    ("10.8-10.9", "10.9.0.34", True),
    (">=10.13.2", "10.13.3", True),
    (">=10.13.2", "10.13.0", False),
    (">=10.13.2,<10.14", "10.14.1", False),
    ("10.13.2+", "10.16.1", True),
    ("~10.11.0", "10.11.5", True),
    ("~10.11.0", "10.12.0", False),
    (">=2.7.1,<=2.8.0a0", "2.8.0", False),
    (">=2.7.1,<=2.8.0a0", "2.7.1+cu128", True),
    ("*", "99.1", True),
    ("12", "12.9", True),
])
def test_range_notation(rng, version, inside):
    assert parse_range(rng).contains(version) is inside
    assert (version in parse_range(rng)) is inside


def test_in_any_is_or():
    assert in_any("11.8", ["11.8", "12.0-12.4"])
    assert in_any("12.3", ["11.8", "12.0-12.4"])
    assert not in_any("12.5", ["11.8", "12.0-12.4"])
    assert in_any("12.5", "12.5")


@pytest.mark.parametrize("bad", ["", "12.x", "12.8-12.0", "abc", ">=", "~x", "1-", 12])
def test_bad_ranges_raise_config_error(bad):
    with pytest.raises(ConfigError):
        parse_range(bad)


@pytest.mark.parametrize("value,expected", [
    (86, "86"), ("86", "86"), ("8.6", "86"), ("sm_86", "86"), ("sm86", "86"), ("SM_86", "86"),
    ("compute_86", "86"), (" sm_86 ", "86"), ("90a", "90a"), ("sm_90a", "90a"), ("9.0a", "90a"),
    ("100", "100"), ("10.0", "100"), ("12.1", "121"), ("sm_120", "120"), (7.5, "75"),
])
def test_normalize_sm(value, expected):
    assert normalize_sm(value) == expected


@pytest.mark.parametrize("bad", ["8.x", "abc", 0, -86, "-86", "8", 8, "sm_", "sm_8", "8.10", "sm_1000",
                                 True, None, "", "86.0", "sm_00", "90b", [86]])
def test_normalize_sm_rejects_junk(bad):
    with pytest.raises(ConfigError):
        normalize_sm(bad)


@given(st.text())
def test_normalize_sm_only_raises_config_error(text):
    try:
        out = normalize_sm(text)
    except ConfigError:
        return
    assert out[:-1].isdigit() or out.isdigit()
    assert normalize_sm(out) == out       # idempotent


@given(st.integers())
def test_normalize_sm_integers(n):
    try:
        out = normalize_sm(n)
    except ConfigError:
        assert n < 10 or n > 999
        return
    assert out == str(n)


def test_sm_to_cc_and_back():
    assert sm_to_cc("86") == "8.6"
    assert sm_to_cc("sm_120") == "12.0"
    assert sm_to_cc("90a") == "9.0"
    assert cc_to_sm("8.9") == "89"
    for sm in ("75", "80", "86", "89", "90", "100", "103", "110", "120", "121"):
        assert normalize_sm(sm_to_cc(sm)) == sm


@pytest.mark.parametrize("value,expected", [
    ("12.1", "12.1"), ("12.1.1", "12.1.1"), ("cu121", "12.1"), ("cu118", "11.8"), ("cu130", "13.0"),
])
def test_normalize_cuda(value, expected):
    assert normalize_cuda(value) == expected


@pytest.mark.parametrize("bad", ["12", "cuda", "cu1", "12.x", None, True, "12.07", "012.8", "12.8.1.2",
                                 "12.8.01", "12.8\n1"])
def test_normalize_cuda_rejects_junk(bad):
    with pytest.raises(ConfigError):
        normalize_cuda(bad)


def test_normalize_driver():
    assert normalize_driver("535") == "535"
    assert normalize_driver(535) == "535"
    assert normalize_driver("550.54.14") == "550.54.14"
    for bad in ("53", "abc", "535.", "r535", None):
        with pytest.raises(ConfigError):
            normalize_driver(bad)
