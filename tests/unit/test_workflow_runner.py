"""The local workflow runner's own rules (tests/workflow_runner.py): GitHub's expression semantics and its
output files, which tests/integration/test_release_workflow.py relies on to run release.yml as shipped."""
import pytest

from tests.workflow_runner import WorkflowError, _key_values, evaluate, interpolate, text

CONTEXT = {"github": {"event": {"inputs": {"select": "", "n": "3"}}}, "inputs": {"locked": True},
           "needs": {"plan": {"result": "success", "outputs": {"matrix": '{"include": [{"id": "a:cpu"}]}'}}},
           "strategy": {"job-index": 2}, "vars": {}, "matrix": {"id": "a:cpu", "runner": ["ubuntu-24.04"]}}


@pytest.mark.parametrize("expression, expected", [
    ("github.event.inputs.select || '*'", "*"),  # an empty input falls back
    ("inputs.locked && '--locked' || ''", "--locked"),
    ("inputs.missing && '--locked' || ''", ""),
    ("vars.MOPT_RUNNER_STATE_DIR || '/var/lib/mopt/state'", "/var/lib/mopt/state"),
    ("fromJSON(needs.plan.outputs.matrix)", {"include": [{"id": "a:cpu"}]}),
    ("always() && needs.plan.result == 'success'", True),
    ("needs.plan.result != 'SUCCESS'", False),  # string comparison ignores case, as GitHub's does
    ("!(strategy.job-index == 2)", False),
    ("matrix.runner[0]", "ubuntu-24.04"),
    ("'it''s'", "it's"),
    ("contains(matrix.id, ':cpu')", True),
])
def test_expressions_follow_githubs_rules(expression, expected):
    assert evaluate(expression, CONTEXT) == expected


def test_success_and_failure_follow_the_job_so_far():
    assert evaluate("success()", CONTEXT, succeeded=False) is False
    assert evaluate("failure()", CONTEXT, succeeded=False) is True
    assert evaluate("always()", CONTEXT, succeeded=False) is True


def test_interpolation_writes_values_as_github_does():
    assert interpolate("id=${{ matrix.id }} n=${{ strategy.job-index }} ${{ inputs.locked }}", CONTEXT) == \
        "id=a:cpu n=2 true"
    assert interpolate("${{ fromJSON(needs.plan.outputs.matrix) }}", CONTEXT) == {"include": [{"id": "a:cpu"}]}
    assert text(None) == "" and text([1]) == "[1]"


@pytest.mark.parametrize("expression", ["hashFiles('x')", "a ===", "(a"])
def test_what_the_runner_does_not_implement_is_named(expression):
    with pytest.raises(WorkflowError):
        evaluate(expression, CONTEXT)


def test_output_files_read_both_forms():
    content = "matrix={\"a\": 1}\nsummary<<EOF\nline 1\nline=2\nEOF\nempty=\n"
    assert _key_values(content) == {"matrix": '{"a": 1}', "summary": "line 1\nline=2", "empty": ""}
