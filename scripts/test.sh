#!/usr/bin/env bash
# The test command: installs and starts what the tests need (scripts/setup.sh: apt packages,
# dockerd, the venv), then runs both tiers: fast unit tests and the integration tests against the
# real Docker daemon and registry. Extra arguments go to pytest (e.g. -m "not integration").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh
export TESTCONTAINERS_RYUK_DISABLED=true
# CI has the machine to itself: the fault test that restarts dockerd (stopping every container) may run.
if [ "${CI:-}" = "true" ]; then export MOPT_ALLOW_DOCKERD_RESTART=1; fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@" tests
