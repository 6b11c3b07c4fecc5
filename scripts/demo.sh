#!/usr/bin/env bash
# The main job on the embedded default, on a fresh Debian 12 machine as root: installs what it
# needs (scripts/setup.sh), then builds, smoke-tests and publishes the cpu demo image into a local
# authenticated registry, pulls it back, serves it and prints the report and a curl line.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup.sh demo
export TESTCONTAINERS_RYUK_DISABLED=true
exec .venv/bin/mopt demo "$@"
