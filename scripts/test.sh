#!/usr/bin/env bash
# The test command: installs and starts what the tests need (scripts/setup.sh: apt packages,
# dockerd, the venv), then runs both tiers: fast unit tests and the integration tests against the
# real Docker daemon and registry. Extra arguments go to pytest (e.g. -m "not integration").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh test
export TESTCONTAINERS_RYUK_DISABLED=true
# CI has the machine to itself: the fault test that restarts dockerd (stopping every container) may run.
if [ "${CI:-}" = "true" ]; then export MOPT_ALLOW_DOCKERD_RESTART=1; fi
# Builds leave stage images behind whenever an input changes (GBs each): before the run, drop mopt's
# images that neither the tests' state nor the demo's names, and keep BuildKit's cache within 20 GiB
# (the vLLM cpu image alone takes about 11 minutes to rebuild when its layers are evicted).
CACHE_GIB="${MOPT_TEST_BUILD_CACHE_GIB:-20}"
.venv/bin/python -m builder prune --state-dir .mopt/test-state --keep-state .mopt --build-cache-gib "$CACHE_GIB" | tail -n 3 \
    || echo "test.sh: mopt prune failed (see above); running the tests anyway" >&2
# The integration tier, one module at a time in name order, but for a second lane: modules whose images
# no other module builds (CUDA from PyPI, torch-inductor: their builds mostly wait on PyPI, unpacking and
# one-threaded compiles while a core idles) run one after the other in a state dir of their own, beside
# the modules of BESIDE. The modules before BESIDE run alone (test_faults restarts dockerd), and so do
# those after it (server timings, prune): the lane is awaited before they start.
LANE=(tests/integration/test_cuda_from_pypi.py tests/integration/test_inductor_cpu.py)
BESIDE=(test_hardened_image test_hub_model test_infra test_lock_repro)
run_integration_tier() {
    local before=() beside=() after=() module name rc=0 lane_rc=0 lane_pid lane_dir
    for module in tests/integration/test_*.py; do
        name="$(basename "$module" .py)"
        if [[ " ${LANE[*]} " == *" $module "* ]]; then continue
        elif [[ " ${BESIDE[*]} " == *" $name "* ]]; then beside+=("$module")
        elif [[ "$name" < "${BESIDE[0]}" ]]; then before+=("$module")
        else after+=("$module"); fi
    done
    local pytest=(.venv/bin/python -m pytest -p no:cacheprovider --durations=10)
    "${pytest[@]}" "${before[@]}" || rc=$?
    lane_dir="$(mktemp -d)"
    (
        lane_started=$SECONDS lane_status=0
        MOPT_TEST_STATE_DIR="$REPO/.mopt/test-state-lane" "${pytest[@]}" --basetemp "$lane_dir/tmp" "${LANE[@]}" \
            || lane_status=$?
        echo "test.sh: the lane took $(( SECONDS - lane_started )) s"
        exit "$lane_status"
    ) > "$lane_dir/log" 2>&1 &
    lane_pid=$!
    "${pytest[@]}" "${beside[@]}" || rc=$((rc ? rc : $?))
    wait "$lane_pid" || lane_rc=$?
    echo "test.sh: beside ${BESIDE[*]}, the lane ran ${LANE[*]}:"
    cat "$lane_dir/log"
    rm -rf "$lane_dir"
    rc=$((rc ? rc : lane_rc))
    "${pytest[@]}" "${after[@]}" || rc=$((rc ? rc : $?))
    return "$rc"
}
rc=0
# The mutation check on a sample of the core's mutants, drawn anew for each commit (the full run and its
# score: docs/testing.md). Only on the plain test command: extra pytest arguments mean a partial run. It
# runs beside pytest, niced (CPU-bound, while the integration tier mostly waits on Docker), and prints
# when pytest is done: together they took 46 min in a row on 2 cores.
sample="${MOPT_MUTATION_SAMPLE:-300}"
mutation_pid=""
if [ "$#" -eq 0 ] && [ "$sample" != 0 ]; then
    seed=$((16#$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)))
    mutation_log="$(mktemp)"
    mutation_tmp="$(mktemp -d)"  # its pytest runs number their temp dirs apart from the main run's
    TMPDIR="$mutation_tmp" nice -n 10 .venv/bin/python scripts/mutation.py --fresh --sample "$sample" --seed "$seed" > "$mutation_log" 2>&1 &
    mutation_pid=$!
fi
if [ "$#" -eq 0 ]; then
    # The tiers one after the other: the integration tier alone (its tests share the daemon, the registry
    # and the state dir), then the unit tier spread over up to 4 processes, one test file to a process
    # (pytest-xdist's loadfile: a file's module fixtures are built once). Side by side, the unit tier's
    # timing tests failed under the builds' load (docs/testing.md).
    workers=$(nproc 2>/dev/null || echo 2)
    workers=$(( workers > 4 ? 4 : workers < 1 ? 1 : workers ))
    started=$SECONDS
    run_integration_tier || rc=$?
    echo "test.sh: the integration tier took $(( SECONDS - started )) s"
    started=$SECONDS
    .venv/bin/python -m pytest -p no:cacheprovider --durations=25 -n "$workers" --dist loadfile tests/unit \
        || rc=$((rc ? rc : $?))
    echo "test.sh: the unit tier took $(( SECONDS - started )) s on $workers processes"
else
    .venv/bin/python -m pytest -p no:cacheprovider --durations=25 "$@" tests || rc=$?
fi
if [ -n "$mutation_pid" ]; then
    mutation_rc=0
    wait "$mutation_pid" || mutation_rc=$?
    cat "$mutation_log"
    rm -rf "$mutation_log" "$mutation_tmp"
    if [ "$mutation_rc" != 0 ]; then rc=$((rc ? rc : 1)); fi
fi
# A CI clone is thrown away after the run: give its images' disk back now, not at the next run.
if [ "${CI:-}" = "true" ]; then
    .venv/bin/python -m builder prune --state-dir .mopt --build-cache-gib "$CACHE_GIB" | tail -n 3 || true
fi
exit "$rc"
