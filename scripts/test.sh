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
rc=0
.venv/bin/python -m pytest -p no:cacheprovider --durations=25 "$@" tests || rc=$?
# The mutation check on a sample of the core's mutants, drawn anew for each commit (the full run and its
# score: docs/testing.md). Only on the plain test command: extra pytest arguments mean a partial run.
sample="${MOPT_MUTATION_SAMPLE:-300}"
if [ "$#" -eq 0 ] && [ "$sample" != 0 ]; then
    seed=$((16#$(git rev-parse --short=7 HEAD 2>/dev/null || echo 0)))
    .venv/bin/python scripts/mutation.py --fresh --sample "$sample" --seed "$seed" || rc=$((rc ? rc : 1))
fi
# A CI clone is thrown away after the run: give its images' disk back now, not at the next run.
if [ "${CI:-}" = "true" ]; then
    .venv/bin/python -m builder prune --state-dir .mopt --build-cache-gib "$CACHE_GIB" | tail -n 3 || true
fi
exit "$rc"
