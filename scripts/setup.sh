#!/usr/bin/env bash
# Prepare a Debian 12 or Ubuntu 24.04 machine for mopt: system packages, a reachable Docker daemon,
# and the project's virtual environment at <repo>/.venv. Run it as root, or as a user with
# passwordless sudo: only apt-get and starting dockerd go through `sudo -n`; the venv and everything
# under the repository belong to the user who runs it.
#
#   bash scripts/setup.sh demo   what `mopt` needs (scripts/demo.sh): the host is torch-free, engines
#                                compile inside the images
#   bash scripts/setup.sh test   that plus what only the tests need (scripts/test.sh; the default):
#                                the runtime's packages (torch, transformers), pytest, a C++
#                                compiler, sudo, Chromium (Debian only: on Ubuntu 24.04 the chromium
#                                package is a snap transition, so a chromium already on PATH is used
#                                and otherwise the report's rendering test skips)
#
# An existing Docker is kept: when a docker CLI is present with its engine (Docker CE with buildx on
# GitHub's hosted runners, or docker.io) docker.io is not installed, and no dockerd is started while
# its daemon answers. docker.io is installed where there is no docker CLI, or a CLI alone (no daemon
# answers, no dockerd, no docker.service).
#
# Idempotent and fast when everything is present: apt-get runs only when a package is missing,
# dockerd is started only when the docker CLI cannot reach a daemon, and pip runs only when
# pyproject.toml (or the interpreter) changed since the last successful install.
#
# Environment knobs:
#   MOPT_PYTHON        interpreter for a new venv (default: python3.11 on PATH, else python3)
#   MOPT_SKIP_APT=1    do not touch system packages (e.g. a machine prepared by other means)
#   MOPT_SKIP_DOCKERD=1  do not start dockerd
#   MOPT_FORCE_PIP=1   reinstall the venv's packages even if the hash matches
#   MOPT_ALLOW_UNSUPPORTED_OS=1  go on on an OS other than Debian 12 / Ubuntu 24.04 (apt names as Debian's)
#   MOPT_OS_RELEASE    the os-release file to read (default /etc/os-release; for tests)
#   MOPT_SETUP_DRY_RUN=1  say what would be installed, started or created, and change nothing
#   MOPT_DOCKER        the docker CLI to check (default: /usr/bin/docker, else docker on PATH)
#   MOPT_DOCKERD       the daemon to start where none answers (default: dockerd on PATH or in sbin)
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
OS_RELEASE="${MOPT_OS_RELEASE:-/etc/os-release}"
DOCKERD_LOG=/var/log/dockerd.log
DOCKER_SOCK=/var/run/docker.sock
DRY_RUN="${MOPT_SETUP_DRY_RUN:-0}"
T0=$(date +%s.%N)

say()  { printf '[setup] %s\n' "$*"; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
dry()  { [ "$DRY_RUN" = 1 ]; }
me()   { id -un 2>/dev/null || id -u; }

# --------------------------------------------------------------------------- OS
os_value() {  # KEY -> its value in $OS_RELEASE, unquoted ("" when absent)
    local v
    v="$(sed -n "s/^$1=//p" "$OS_RELEASE" | tail -n 1)"
    v="${v#[\"\']}"; v="${v%[\"\']}"
    printf '%s' "$v"
}

detect_os() {  # sets OS_ID (debian or ubuntu: which apt names to use) and OS_NAME
    local id="" version="" like="" pretty=""
    if [ -r "$OS_RELEASE" ]; then
        id="$(os_value ID)"; version="$(os_value VERSION_ID)"; like="$(os_value ID_LIKE)"
        pretty="$(os_value PRETTY_NAME)"
    fi
    OS_NAME="${pretty:-unknown (no readable $OS_RELEASE)}"
    case "$id:$version" in
        debian:12) OS_ID=debian; say "OS: Debian 12" ; return ;;
        ubuntu:24.04) OS_ID=ubuntu; say "OS: Ubuntu 24.04"; return ;;
    esac
    case " $id $like " in
        *" ubuntu "*) OS_ID=ubuntu ;;
        *) OS_ID=debian ;;
    esac
    if [ "${MOPT_ALLOW_UNSUPPORTED_OS:-0}" != 1 ]; then
        die "unsupported OS: $OS_NAME (ID=${id:-?} VERSION_ID=${version:-?}); supported: Debian 12, Ubuntu 24.04; set MOPT_ALLOW_UNSUPPORTED_OS=1 to try anyway with $OS_ID's package names"
    fi
    say "OS: WARNING $OS_NAME is not supported (Debian 12, Ubuntu 24.04); going on with $OS_ID's package names (MOPT_ALLOW_UNSUPPORTED_OS=1)"
}

# --------------------------------------------------------------------------- privileges
# Every privileged action (apt-get, starting dockerd, writing under /etc or /var) runs as
# "${SUDO[@]}" CMD: nothing as root, `sudo -n` otherwise. Nothing under the repository is ever
# written through sudo.
SUDO=()
SUDO_READY=0

privileges() {  # one phrase: how this script gets root, or why it cannot (never prompts)
    if [ "$(id -u)" -eq 0 ]; then
        echo "root"
    elif ! command -v sudo >/dev/null 2>&1; then
        echo "none: not root and sudo is not installed"
    elif ! sudo -n true >/dev/null 2>&1; then
        echo "none: not root and 'sudo -n' needs a password for $(me)"
    else
        echo "sudo -n"
    fi
}

need_root() {  # $1: what needs it; sets SUDO or exits with one line
    [ "$SUDO_READY" = 1 ] && return
    local how
    how="$(privileges)"
    case "$how" in
        root) SUDO=() ;;
        "sudo -n") SUDO=(sudo -n) ;;
        *) die "$1 needs root, and there is $how; run this script as root, or give $(me) passwordless sudo (a NOPASSWD rule in /etc/sudoers.d)" ;;
    esac
    SUDO_READY=1
}

# --------------------------------------------------------------------------- system packages
# Package name -> why. xz-utils/iptables/debian-archive-keyring are named explicitly because
# we install without Recommends. The names exist on Debian 12 and on Ubuntu 24.04 (universe).
DOCKER_PACKAGES=(
    docker.io            # Engine + /usr/bin/docker with built-in BuildKit: only without any docker CLI
    iptables             # dockerd's bridge networking
)
PACKAGES=(
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
    sudo                 # tests/integration/test_setup_script.py runs this script as a sudo user
)

docker_cli() {  # the docker CLI to use, or "": the order of builder/dockerclient.py's candidates
    if [ -n "${MOPT_DOCKER:-}" ]; then
        echo "$MOPT_DOCKER"
    elif [ -x /usr/bin/docker ]; then
        echo /usr/bin/docker
    else
        command -v docker 2>/dev/null || true
    fi
}

dockerd_path() {  # the daemon binary to start, or "" (it lives in sbin, which a user's PATH may lack)
    PATH="$PATH:/usr/sbin:/sbin" command -v "${MOPT_DOCKERD:-dockerd}" 2>/dev/null || true
}

docker_service() { systemd_running && systemctl cat docker.service >/dev/null 2>&1; }  # systemd can start one

has_engine() {  # the docker CLI found has a daemon: one answers, or one can be started here
    [ -n "${DOCKER_HOST:-}" ] && return 0
    DOCKER="$(docker_cli)"
    probe_docker
    [ "$DOCKER_STATE" != down ] && return 0
    [ -n "$(dockerd_path)" ] && return 0
    docker_service
}

choose_packages() {
    if [ -z "$(docker_cli)" ]; then
        PACKAGES=("${DOCKER_PACKAGES[@]}" "${PACKAGES[@]}")
    elif has_engine; then
        say "docker: $(docker_cli) present: kept as it is (docker.io is installed only where no Docker engine exists)"
    else
        # A client alone (a docker CLI copied onto the machine, no daemon and no dockerd): Debian's
        # engine goes beside it, and its own /usr/bin/docker is the CLI used from then on.
        say "docker: $(docker_cli) is a client without a daemon (no dockerd here): docker.io is installed beside it"
        PACKAGES=("${DOCKER_PACKAGES[@]}" "${PACKAGES[@]}")
    fi
    [ "$PURPOSE" = test ] || return 0
    PACKAGES+=("${TEST_PACKAGES[@]}")
    if [ "$OS_ID" = debian ]; then
        PACKAGES+=(chromium)  # headless rendering check of the HTML release report
    elif command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        say "chromium: using $(command -v chromium || command -v chromium-browser)"
    else
        say "chromium: skipped on Ubuntu (its chromium-browser package only installs the snap); the report's rendering test will skip"
    fi
}

is_installed() {
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null || true)" = "installed" ]
}

systemd_running() { [ -d /run/systemd/system ]; }

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        is_installed "$p" || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        say "system packages: all present"
        return
    fi
    if dry; then
        say "system packages: would install ${missing[*]} (privileges: $(privileges))"
        return
    fi
    command -v apt-get >/dev/null 2>&1 || die "missing packages (${missing[*]}) and no apt-get to install them"
    need_root "installing ${missing[*]}"
    say "system packages: installing ${missing[*]}${SUDO[*]:+ (through ${SUDO[*]})}"
    "${SUDO[@]}" apt-get update -qq -o Acquire::Retries=3
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o Acquire::Retries=3 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        "${missing[@]}" >/dev/null
    for p in "${missing[@]}"; do
        is_installed "$p" || die "package $p did not install"
    done
    say "system packages: installed ${#missing[@]}"
    # Under systemd the package starts its own registry service on :5000, the port of mopt's local
    # registry (mopt runs docker-registry itself): stop and disable the service we just installed.
    if [[ " ${missing[*]} " == *" docker-registry "* ]] && systemd_running; then
        "${SUDO[@]}" systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
        say "system packages: disabled the docker-registry service (mopt runs its own registry)"
    fi
}

# --------------------------------------------------------------------------- docker daemon
DOCKER_STATE=""
DOCKER_PROBLEM=""
probe_docker() {  # sets DOCKER_STATE (up, denied or down) and DOCKER_PROBLEM (the CLI's error line)
    local out
    # `version` rather than `info`: its error goes to stderr on every client (20.10's info prints it
    # to stdout and "errors pretty printing info" to stderr).
    if out="$(timeout 60 "$DOCKER" version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
        DOCKER_STATE=up DOCKER_PROBLEM=""
        return
    fi
    DOCKER_PROBLEM="$(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1)"
    case "$out" in
        *"ermission denied"*) DOCKER_STATE=denied ;;
        *) DOCKER_STATE=down ;;
    esac
}

in_docker_group() {  # [USER]: in the docker group (this session's groups without USER, the database's with)
    id -nG "$@" 2>/dev/null | tr ' ' '\n' | grep -qx docker
}

no_access() {  # one line: why this user cannot use the daemon's socket, and the fix
    local user sock
    user="$(me)"
    sock="$(stat -c '%U:%G %a' "$DOCKER_SOCK" 2>/dev/null || echo '?')"
    if [ "$(stat -c %G "$DOCKER_SOCK" 2>/dev/null)" != docker ]; then
        echo "docker: permission denied on $DOCKER_SOCK ($sock): give $user access through a docker group: 'sudo groupadd docker', restart the daemon, 'sudo usermod -aG docker $user', log in again, then rerun"
    elif in_docker_group; then
        echo "docker: permission denied on $DOCKER_SOCK ($sock) although $user is in the docker group ($DOCKER_PROBLEM)"
    elif in_docker_group "$user"; then
        echo "docker: permission denied on $DOCKER_SOCK ($sock): $user is in the docker group but this session is not; log in again (or run 'newgrp docker'), then rerun"
    else
        echo "docker: permission denied on $DOCKER_SOCK ($sock): $user is not in the docker group; run 'sudo usermod -aG docker $user', log in again, then rerun (mopt and its tests use the daemon's socket directly: 'sudo docker' is no substitute)"
    fi
}

proc_alive() { [ -n "$1" ] && [ -d "/proc/$1" ]; }  # also for root's processes (kill -0 is not)

start_dockerd() {
    local started=""
    DOCKER="$(docker_cli)"
    if [ -z "$DOCKER" ] && dry; then
        say "docker: would start docker.io's daemon (privileges: $(privileges))"
        return
    fi
    [ -n "$DOCKER" ] && [ -x "$DOCKER" ] || die "no docker CLI found (install docker.io, or Docker CE)"
    probe_docker
    case "$DOCKER_STATE" in
        up)
            say "docker: $DOCKER reachable (client $("$DOCKER" version --format '{{.Client.Version}}' 2>/dev/null), daemon $("$DOCKER" version --format '{{.Server.Version}}' 2>/dev/null)$("$DOCKER" buildx version >/dev/null 2>&1 && echo ', buildx'))"
            return ;;
        denied) dry && { say "would stop here: $(no_access)"; return; }
            die "$(no_access)" ;;
    esac
    if [ -n "${DOCKER_HOST:-}" ]; then
        die "docker: the daemon at DOCKER_HOST=$DOCKER_HOST does not answer ($DOCKER_PROBLEM); this script starts only the system daemon"
    fi
    if [ "${MOPT_SKIP_DOCKERD:-0}" = 1 ]; then
        die "docker daemon not reachable and MOPT_SKIP_DOCKERD=1"
    fi
    if dry; then
        say "docker: would start the daemon (privileges: $(privileges))"
        return
    fi
    need_root "starting the Docker daemon"
    # A live pid file means a daemon is starting (or hung): wait for it rather than start another.
    # (pid file instead of pgrep: procps is not on every minimal machine.)
    local pidfile=/var/run/docker.pid
    if [ -f "$pidfile" ] && proc_alive "$(cat "$pidfile" 2>/dev/null)"; then
        say "docker daemon: dockerd (pid $(cat "$pidfile")) is running, waiting for it"
    elif docker_service; then
        say "docker daemon: systemctl start docker"
        "${SUDO[@]}" systemctl start docker.service || die "systemctl start docker failed (see 'journalctl -u docker')"
    else
        # CI containers and fresh VMs often have no running systemd: start the daemon directly.
        "${SUDO[@]}" rm -f "$pidfile"  # stale: a killed daemon's pid file makes dockerd refuse to start
        local dockerd
        dockerd="$(dockerd_path)"
        [ -n "$dockerd" ] || die "dockerd not found (apt-get install docker.io)"
        say "docker daemon: starting $dockerd (log: $DOCKERD_LOG)"
        # The log is opened by the privileged shell (/var/log is root's); sudo's own output goes to
        # /dev/null too, or it would hold this script's stdout open as long as the daemon runs.
        # Without the caller's TMPDIR: the daemon outlives this script, and runc writes each `docker exec`'s
        # files there, so a temp dir removed later (scripts/test.sh's own) would break every exec after it.
        # shellcheck disable=SC2016  # $0 and $1 expand in that shell
        "${SUDO[@]}" env -u TMPDIR setsid sh -c 'exec "$0" >"$1" 2>&1 </dev/null' "$dockerd" "$DOCKERD_LOG" \
            </dev/null >/dev/null 2>&1 &
        started=$!
    fi
    local i
    for i in $(seq 1 60); do
        probe_docker
        [ "$DOCKER_STATE" = denied ] && die "$(no_access)"
        if [ "$DOCKER_STATE" = up ]; then
            say "docker daemon: up after ${i}s"
            return
        fi
        if [ -n "$started" ] && ! proc_alive "$started"; then
            tail -n 20 "$DOCKERD_LOG" >&2 || true
            die "dockerd exited at once (see $DOCKERD_LOG)"
        fi
        sleep 1
    done
    tail -n 20 "$DOCKERD_LOG" >&2 || true
    die "docker daemon did not answer 'docker version' within 60 s (see $DOCKERD_LOG)"
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
        dry && { say "venv: would recreate $VENV (interpreter gone)"; return; }
        say "venv: $VENV is broken (interpreter gone), recreating"
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        local py
        if dry; then  # the interpreter may come with the packages above
            say "venv: would create $VENV with ${MOPT_PYTHON:-python3.11 or python3} and pip install -e '.$EXTRAS'"
            return
        fi
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
    dry && { say "venv: would pip install -e '.$EXTRAS'"; return; }
    if [ "$PURPOSE" = test ] && [ -z "${PIP_FIND_LINKS:-}" ] && ! "$VENV/bin/pip" config list 2>/dev/null | grep -q find-links; then
        say "venv: WARNING no pip find-links set: torch will come from the index (large CUDA build)"
    fi
    say "venv: pip install -e '.$EXTRAS' (quiet; can take a few minutes)"
    rm -f "$STAMP"
    # This machine's pip.conf names index directories that may not exist; pip then warns once per
    # package ("Location ... is ignored"). Drop just that noise, keep every other message.
    # --no-compile, then compileall over every core: pip byte-compiles on one (a fresh test venv: 90 s in
    # all with pip's compile, 53 + 26 s this way on 2 cores).
    (cd "$REPO" && "$VENV/bin/python" -m pip install -q --no-compile --disable-pip-version-check -e ".$EXTRAS") \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true)
    # -qq: a few packages ship files of another Python's syntax (templates, test data), as pip's compile skips them.
    "$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
        >/dev/null 2>&1 || true
    echo "$key $EXTRAS" >"$STAMP"
    say "venv: installed"
}

hand_back() {
    # Run as root (e.g. `sudo bash scripts/setup.sh`) in a checkout that belongs to someone else:
    # what pip wrote (the venv, the editable install's egg-info) goes back to the checkout's owner.
    [ "$(id -u)" -eq 0 ] || return 0
    local uid owner
    uid="$(stat -c %u "$REPO")"; owner="$uid:$(stat -c %g "$REPO")"
    [ "$uid" != 0 ] || return 0
    # (an unmatched *.egg-info stays literal: find complains about it, silenced)
    [ -n "$(find "$VENV" "$REPO"/*.egg-info ! -uid "$uid" -print -quit 2>/dev/null)" ] || return 0
    chown -R -h "$owner" "$VENV"
    find "$REPO" -maxdepth 1 -name '*.egg-info' -exec chown -R -h "$owner" {} +
    say "venv: handed to $(stat -c %U "$REPO"), the checkout's owner"
}

# --------------------------------------------------------------------------- main
detect_os
dry && say "dry run: nothing is changed (privileges: $(privileges))"
if [ "${MOPT_SKIP_APT:-0}" = 1 ]; then
    say "system packages: skipped (MOPT_SKIP_APT=1)"
else
    choose_packages
    install_packages
fi
start_dockerd
setup_venv
dry && { say "dry run: done"; exit 0; }
hand_back
say "done in $(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
