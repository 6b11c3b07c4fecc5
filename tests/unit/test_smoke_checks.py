"""The embedding smoke checks' verdicts (builder/smoke.py), without a container: dimension,
L2 normalisation, determinism and accuracy against the compile-time reference at the recipe's
min_cosine."""
from __future__ import annotations

import math

import pytest

from builder.errors import SmokeTestError
from builder.smoke import (
    check_accuracy,
    check_deterministic,
    check_dimension,
    check_normalised,
    cosine,
    min_reference_cosine,
)


def failure(fn, *args) -> str:
    with pytest.raises(SmokeTestError) as exc:
        fn(*args)
    assert exc.value.exit_code == 5
    return str(exc.value)


@pytest.mark.parametrize("a, b, expected", [
    ([1.0, 0.0], [2.0, 0.0], 1.0),
    ([1.0, 0.0], [0.0, 3.0], 0.0),
    ([1.0, 2.0], [-1.0, -2.0], -1.0),
    ([3.0, 4.0], [4.0, 3.0], 24 / 25),
    ([0.0, 0.0], [1.0, 1.0], 0.0),  # a zero vector: 0, not a division by zero
])
def test_cosine(a, b, expected):
    assert cosine(a, b) == pytest.approx(expected, abs=1e-12)


def test_cosine_of_different_lengths():
    with pytest.raises(ValueError):
        cosine([1.0, 2.0], [1.0])


def test_dimension():
    check_dimension([[0.0] * 3, [1.0] * 3], 3)
    assert failure(check_dimension, [[0.0] * 3, [0.0] * 2], 3) == "expected dimension 3, got [2, 3]"
    assert failure(check_dimension, [[0.0] * 4], 3) == "expected dimension 3, got [4]"
    assert failure(check_dimension, [], 3) == "expected dimension 3, got []"


@pytest.mark.parametrize("norm", [1.0, 1.0009, 0.9991])
def test_normalised_within_tolerance(norm):
    check_normalised([[norm, 0.0], [0.0, 1.0]], True)


@pytest.mark.parametrize("norm", [1.0011, 0.9989, 2.0, 0.0])
def test_not_normalised(norm):
    assert failure(check_normalised, [[0.6, 0.8], [norm, 0.0]], True) == f"norms [1.0, {norm}] are not 1"


def test_normalisation_not_checked_when_the_recipe_does_not_normalise():
    check_normalised([[3.0, 4.0]], False)


def test_deterministic():
    check_deterministic([[0.5, 0.25], [1.0, 0.0]], [[0.5, 0.25], [1.0, 0.0]])
    check_deterministic([[0.5, 0.25], [1.0, 0.0]], [[0.5, 0.25], [1.0, 9e-6]])


@pytest.mark.parametrize("again, worst", [
    ([[0.5, 0.25], [1.0, 1e-5]], "1.00e-05"),  # the tolerance itself fails
    ([[0.5, 0.2], [1.0, -2e-5]], "5.00e-02"),  # the worst element of any vector is named
    ([[0.5, 0.25], [0.9, 0.0]], "1.00e-01"),
])
def test_not_deterministic(again, worst):
    assert failure(check_deterministic, [[0.5, 0.25], [1.0, 0.0]], again) == (
        f"two identical requests differ by up to {worst}")


@pytest.mark.parametrize("again", [[[1.0, 2.0]], [[1.0, 2.0], [3.0]], [[1.0, 2.0], [3.0, 4.0, 5.0]]])
def test_deterministic_needs_the_same_shape(again):
    # A repeat that drops a vector or a dimension is not "the same answer" (the check reports the ValueError).
    with pytest.raises(ValueError):
        check_deterministic([[1.0, 2.0], [3.0, 4.0]], again)


REFERENCE = {"texts": ["b", "a", "c"], "embeddings": [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]}


def test_min_reference_cosine_pairs_each_text_with_its_reference():
    # Texts in another order than reference.json's; "a" is exact, "b" is at 45 degrees.
    got = min_reference_cosine(["a", "b"], [[2.0, 0.0], [1.0, 1.0]], REFERENCE)
    assert got == pytest.approx(1 / math.sqrt(2))
    assert min_reference_cosine(["c"], [[3.0, 3.0]], REFERENCE) == pytest.approx(1.0)


def test_min_reference_cosine_of_a_text_without_reference():
    with pytest.raises(KeyError):
        min_reference_cosine(["d"], [[1.0, 0.0]], REFERENCE)


def test_min_reference_cosine_needs_a_vector_per_text():
    # A server answering fewer vectors than texts must not pass on the ones it did answer.
    with pytest.raises(ValueError):
        min_reference_cosine(["a", "b"], [[1.0, 0.0]], REFERENCE)


def test_min_reference_cosine_refuses_a_malformed_reference():
    with pytest.raises(ValueError):
        min_reference_cosine(["a"], [[1.0, 0.0]], {"texts": ["a", "b"], "embeddings": [[1.0, 0.0]]})


@pytest.mark.parametrize("min_cos, threshold", [(0.99, 0.99), (0.995, 0.99), (1.0, 0.999)])
def test_accuracy_at_or_above_the_threshold_passes(min_cos, threshold):
    check_accuracy(min_cos, threshold)


@pytest.mark.parametrize("min_cos, threshold, message", [
    (0.85, 0.99, "cosine vs reference 0.85000 < threshold 0.99"),
    (0.989999, 0.99, "cosine vs reference 0.99000 < threshold 0.99"),
    (-0.5, 0.9, "cosine vs reference -0.50000 < threshold 0.9"),
])
def test_accuracy_below_the_threshold_fails_with_the_figure(min_cos, threshold, message):
    assert failure(check_accuracy, min_cos, threshold) == message


def test_nan_never_passes():
    nan = float("nan")
    with pytest.raises(SmokeTestError, match="cosine vs reference nan < threshold 0.99"):
        check_accuracy(nan, 0.99)
    with pytest.raises(SmokeTestError, match="differ by up to nan"):
        check_deterministic([[1.0, nan]], [[1.0, nan]])


def test_the_smoke_texts_are_the_inputs_then_the_gates_and_a_miss_names_its_length_class():
    from builder.smoke import smoke_texts, worst_length_class

    reference = {"texts": ["a", "b c", "d e f g h i j k l m"], "tokens": [3, 4, 12],
                 "embeddings": [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]}
    texts = smoke_texts(("b c", "a"), reference)
    assert texts == ["b c", "a", "d e f g h i j k l m"]
    assert smoke_texts(("x",), {}) == ["x"]
    vectors = [[1.0, 0.0], [1.0, 0.0], [0.6, 0.8]]  # the long text is off: cosine 0.6
    assert worst_length_class(texts, vectors, reference) == "9-32-token texts min 0.60000"
    with pytest.raises(SmokeTestError, match=r"^cosine vs reference 0.60000 < threshold 0.99 \(worst: 9-32-token "
                                             r"texts min 0.60000\)$"):
        check_accuracy(0.6, 0.99, lambda: worst_length_class(texts, vectors, reference))
    del reference["tokens"]  # a reference of an earlier compile: no token counts
    assert worst_length_class(texts, vectors, reference) == "unknown length min 0.60000"
