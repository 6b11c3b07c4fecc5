#!/usr/bin/env bash
# Prepare a Debian 12 machine (as root) for mopt: system packages, a running Docker daemon,
# and the project's virtual environment at <repo>/.venv.
#
#   bash scripts/setup.sh demo   what `mopt` needs (scripts/demo.sh): the host is torch-free, engines
#                                compile inside the images
#   bash scripts/setup.sh test   that plus what only the tests need (scripts/test.sh; the default):
#                                the runtime's packages (torch, transformers), pytest, a C++
#                                compiler, Chromium
#
# Idempotent and fast when everything is present: apt-get runs only when a package is missing,
# dockerd is started only when /usr/bin/docker cannot reach a daemon, and pip runs only when
# pyproject.toml (or the interpreter) changed since the last successful install.
#
# Environment knobs:
#   MOPT_PYTHON        interpreter for a new venv (default: python3.11 on PATH, else python3)
#   MOPT_SKIP_APT=1    do not touch system packages (e.g. a machine prepared by other means)
#   MOPT_SKIP_DOCKERD=1  do not start dockerd
#   MOPT_FORCE_PIP=1   reinstall the venv's packages even if the hash matches
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PURPOSE="${1:-test}"
case "$PURPOSE" in
    demo) EXTRAS="" ;;
    test) EXTRAS="[test,runtime]" ;;
    *) printf '[setup] ERROR: unknown purpose %s (demo or test)\n' "$PURPOSE" >&2; exit 2 ;;
esac
VENV="$REPO/.venv"
STAMP="$VENV/.mopt-setup-key"
DOCKER=/usr/bin/docker
DOCKERD_LOG=/var/log/dockerd.log
T0=$(date +%s.%N)

say()  { printf '[setup] %s\n' "$*"; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# --------------------------------------------------------------------------- system packages
# Package name -> why. xz-utils/iptables/debian-archive-keyring are named explicitly because
# we install without Recommends.
PACKAGES=(
    docker.io            # Engine 20.10 + /usr/bin/docker with built-in BuildKit
    iptables             # dockerd's bridge networking
    docker-registry      # CNCF distribution: the local authenticated registry
    mmdebstrap           # reproducible Debian rootfs for base images
    debootstrap          # fallback rootfs builder
    debian-archive-keyring
    skopeo               # inspect/copy images in registries
    python3 python3-venv
    curl ca-certificates git xz-utils
)
# Only the tests: the runtime as a plain program, its compile and the report's rendering check.
TEST_PACKAGES=(
    python3-dev
    gcc g++              # AOTInductor on CPU needs a C++ compiler
    chromium             # headless rendering check of the HTML release report
)
if [ "$PURPOSE" = test ]; then
    PACKAGES+=("${TEST_PACKAGES[@]}")
fi

is_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = "installed" ]
}

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        is_installed "$p" || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        say "system packages: all present"
        return
    fi
    [ "$(id -u)" -eq 0 ] || die "missing packages (${missing[*]}) and not root; run as root"
    say "system packages: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq -o Acquire::Retries=3
    apt-get install -y -qq --no-install-recommends -o Acquire::Retries=3 \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" >/dev/null
    for p in "${missing[@]}"; do
        is_installed "$p" || die "package $p did not install"
    done
    say "system packages: installed ${#missing[@]}"
}

# --------------------------------------------------------------------------- docker daemon
daemon_up() { "$DOCKER" info >/dev/null 2>&1; }

start_dockerd() {
    local started=""
    [ -x "$DOCKER" ] || die "$DOCKER not found (apt-get install docker.io)"
    if daemon_up; then
        say "docker daemon: reachable ($("$DOCKER" version --format '{{.Server.Version}}' 2>/dev/null))"
        return
    fi
    if [ "${MOPT_SKIP_DOCKERD:-0}" = 1 ]; then
        die "docker daemon not reachable and MOPT_SKIP_DOCKERD=1"
    fi
    # The Debian docker.io package ships systemd units, but CI containers and fresh VMs
    # often have no running systemd, so start the daemon directly unless one is running.
    # A live pid file means a daemon is starting (or hung): wait for it rather than start another.
    # (pid file instead of pgrep: procps is not on every minimal machine.)
    local pidfile=/var/run/docker.pid
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; then
        say "docker daemon: dockerd (pid $(cat "$pidfile")) is running, waiting for it"
    else
        rm -f "$pidfile"  # stale: a killed daemon's pid file makes dockerd refuse to start
        local dockerd
        dockerd="$(PATH="$PATH:/usr/sbin:/sbin" command -v dockerd || true)"
        [ -n "$dockerd" ] || die "dockerd not found (apt-get install docker.io)"
        say "docker daemon: starting $dockerd (log: $DOCKERD_LOG)"
        setsid nohup "$dockerd" >"$DOCKERD_LOG" 2>&1 </dev/null &
        started=$!
    fi
    local i
    for i in $(seq 1 60); do
        if daemon_up; then
            say "docker daemon: up after ${i}s"
            return
        fi
        if [ -n "$started" ] && ! kill -0 "$started" 2>/dev/null; then
            tail -n 20 "$DOCKERD_LOG" >&2 || true
            die "dockerd exited at once (see $DOCKERD_LOG)"
        fi
        sleep 1
    done
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    die "docker daemon did not answer 'docker info' within 60 s (see $DOCKERD_LOG)"
}

# --------------------------------------------------------------------------- venv
pick_python() {
    local py="${MOPT_PYTHON:-}"
    if [ -z "$py" ]; then
        py="$(command -v python3.11 || command -v python3 || true)"
    fi
    [ -n "$py" ] || die "no python3 found"
    "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
        || die "$py is older than 3.11"
    echo "$py"
}

venv_key() {
    # Inputs that decide what the venv must contain: the project's dependencies, the
    # interpreter, and where pip finds local wheels.
    {
        cat "$REPO/pyproject.toml"
        "$VENV/bin/python" -c 'import sys; print(sys.version)'
        echo "${PIP_FIND_LINKS:-}"
    } | sha256sum | cut -d' ' -f1
}

setup_venv() {
    if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
        say "venv: $VENV is broken (interpreter gone), recreating"
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        local py
        py="$(pick_python)"
        say "venv: creating $VENV with $py ($("$py" -c 'import platform; print(platform.python_version())'))"
        "$py" -m venv "$VENV"
    fi
    local key have
    key="$(venv_key)"
    have="$(cat "$STAMP" 2>/dev/null || true)"
    # The stamp is "KEY EXTRAS": a venv set up for the tests has everything the demo needs too.
    if [ "${MOPT_FORCE_PIP:-0}" != 1 ] && { [ "$have" = "$key $EXTRAS" ] || [ "$have" = "$key [test,runtime]" ]; }; then
        say "venv: up to date ($PURPOSE)"
        return
    fi
    if [ "$PURPOSE" = test ] && [ -z "${PIP_FIND_LINKS:-}" ] && ! "$VENV/bin/pip" config list 2>/dev/null | grep -q find-links; then
        say "venv: WARNING no pip find-links set: torch will come from the index (large CUDA build)"
    fi
    say "venv: pip install -e '.$EXTRAS' (quiet; can take a few minutes)"
    rm -f "$STAMP"
    # This machine's pip.conf names index directories that may not exist; pip then warns once per
    # package ("Location ... is ignored"). Drop just that noise, keep every other message.
    (cd "$REPO" && "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".$EXTRAS") \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true)
    echo "$key $EXTRAS" >"$STAMP"
    say "venv: installed"
}

# --------------------------------------------------------------------------- main
if [ "${MOPT_SKIP_APT:-0}" = 1 ]; then
    say "system packages: skipped (MOPT_SKIP_APT=1)"
else
    install_packages
fi
start_dockerd
setup_venv
say "done in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
