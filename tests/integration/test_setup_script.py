"""scripts/setup.sh per purpose, run for real on a copy of the scripts beside a small project of its own
(its venv is made by the real script with the real pip; apt is skipped, the Docker daemon must answer):
the demo's venv holds the project alone, the tests' adds the extras, a tests' venv serves the demo
as it is, and an unknown purpose exits 2 before touching anything. Then as a fresh non-root user with
passwordless sudo in a clone of the repository (the demo's setup, exit 0, nothing in the clone owned by
root), as a user without access to the daemon's socket (one line naming the fix), and its OS detection
against fake os-release files (Ubuntu 24.04 supported, anything else refused unless overridden)."""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "setup-probe"
version = "0"
dependencies = []

[project.optional-dependencies]
test = []
runtime = []

[tool.setuptools]
py-modules = []
"""


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    return tmp_path


def setup(project: Path, *purpose: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOPT_SKIP_APT": "1", "MOPT_SKIP_DOCKERD": "1"}
    return subprocess.run(["bash", str(project / "scripts" / "setup.sh"), *purpose], env=env,
                          capture_output=True, text=True, timeout=240)


def stamp(project: Path) -> str:
    return (project / ".venv" / ".mopt-setup-key").read_text()


@pytest.mark.timeout(600)
def test_each_purpose_installs_its_own_set_and_a_test_venv_serves_the_demo(project):
    demo = setup(project, "demo")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "pip install -e '.'" in demo.stdout and stamp(project).endswith(" \n")
    again = setup(project, "demo")
    assert "venv: up to date (demo)" in again.stdout, again.stdout
    test = setup(project, "test")  # the demo's venv lacks the test extras: pip runs again
    assert test.returncode == 0, test.stdout + test.stderr
    assert "pip install -e '.[test,runtime]'" in test.stdout and stamp(project).endswith(" [test,runtime]\n")
    for purpose in ("demo", "test"):
        assert f"venv: up to date ({purpose})" in setup(project, purpose).stdout
    assert "venv: up to date (test)" in setup(project).stdout  # no purpose: the tests'


@pytest.mark.timeout(60)
def test_an_unknown_purpose_exits_2_before_anything(project):
    result = setup(project, "everything")
    assert result.returncode == 2 and "unknown purpose everything (demo or test)" in result.stderr
    assert not (project / ".venv").exists()


def test_the_readme_commands_pass_their_purpose():
    assert "bash scripts/setup.sh demo\n" in (REPO / "scripts" / "demo.sh").read_text()
    assert "bash scripts/setup.sh test\n" in (REPO / "scripts" / "test.sh").read_text()


# --------------------------------------------------------------------------- as a fresh non-root user
SOCKET = Path("/var/run/docker.sock")
USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


def _need_root_and_sudo() -> None:
    """Preconditions that fail (never skip): creating users needs root, and the user's setup needs sudo,
    which `bash scripts/setup.sh test` installs."""
    assert os.geteuid() == 0, "these tests create users: run them as root (scripts/test.sh does)"
    assert shutil.which("sudo"), "sudo is not installed: run `bash scripts/setup.sh test` (it installs sudo)"


@pytest.fixture
def make_user():
    """make_user(sudo=..., docker=...) -> a fresh user with a temp home of its own (mode 700 under /tmp);
    with sudo, a NOPASSWD rule in /etc/sudoers.d; with docker, membership of the socket's group. Every
    user, rule and home is removed afterwards."""
    made: list[tuple[str, Path, Path | None]] = []

    def make(*, sudo: bool, docker: bool) -> pwd.struct_passwd:
        name = "moptsetup" + secrets.token_hex(4)
        home = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
        subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/bash",
                        "--user-group", name], check=True, capture_output=True, timeout=30)
        rule = None
        if sudo:
            rule = Path("/etc/sudoers.d") / name
            made.append((name, home, rule))
            rule.write_text(f"{name} ALL=(ALL) NOPASSWD: ALL\n")
            rule.chmod(0o440)
        else:
            made.append((name, home, None))
        if docker:
            subprocess.run(["usermod", "-aG", SOCKET.group(), name], check=True, capture_output=True, timeout=30)
        user = pwd.getpwnam(name)
        os.chown(home, user.pw_uid, user.pw_gid)
        home.chmod(0o700)
        return user

    yield make
    for name, home, rule in made:
        if rule is not None:
            rule.unlink(missing_ok=True)
        subprocess.run(["userdel", name], capture_output=True, timeout=30)
        shutil.rmtree(home, ignore_errors=True)


def as_user(user: pwd.struct_passwd, argv: list[str], cwd: Path, timeout: float,
            **env: str) -> subprocess.CompletedProcess:
    """Run ARGV as USER with its groups (as a login would give them), its HOME and a plain PATH; pip's
    settings from this environment (PIP_*) pass through, nothing else does."""
    groups = [g for g in os.getgrouplist(user.pw_name, user.pw_gid) if g != user.pw_gid]
    base = {"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name, "PATH": USER_PATH,
            "LANG": "C.UTF-8", **{k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
    return subprocess.run(argv, cwd=cwd, env={**base, **env}, user=user.pw_uid, group=user.pw_gid,
                          extra_groups=groups, capture_output=True, text=True, timeout=timeout)


def not_owned_by(user: pwd.struct_passwd, root: Path) -> list[str]:
    """Every path under ROOT (itself included) whose owner is not USER."""
    bad = [str(root)] if root.lstat().st_uid != user.pw_uid else []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if path.lstat().st_uid != user.pw_uid:
                bad.append(f"{path} (uid {path.lstat().st_uid})")
    return bad


@pytest.mark.timeout(900)
def test_a_fresh_sudo_user_sets_up_the_demo_in_its_clone_and_owns_everything(make_user):
    """A fresh user with passwordless sudo, in the socket's group, clones HEAD into its own home (the
    working tree's setup.sh copied over it) and runs `bash scripts/setup.sh demo`: exit 0, the running
    Docker kept, the venv made, nothing under the clone owned by anyone else; a second run is up to date.
    Where the socket belongs to root:root (no group to join) the expected outcome is the one line that
    says how to give the user access, and no venv."""
    _need_root_and_sudo()
    assert SOCKET.is_socket(), f"no Docker daemon socket at {SOCKET}"
    group_access = SOCKET.group() != "root" and SOCKET.stat().st_mode & 0o060 == 0o060  # the group may use it
    user = make_user(sudo=True, docker=group_access)
    home = Path(user.pw_dir)
    clone = home / "mopt"
    # The checkout belongs to root: the user's git must be told it is safe to read (a local clone's
    # upload-pack ignores `git -c`, so through the user's own ~/.gitconfig).
    gitdir = subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=REPO, capture_output=True, text=True,
                            check=True, timeout=30).stdout.strip()  # a worktree's git dir lies elsewhere
    (home / ".gitconfig").write_text(f"[safe]\n\tdirectory = {REPO}\n\tdirectory = {REPO}/.git\n"
                                     f"\tdirectory = {gitdir}\n")
    os.chown(home / ".gitconfig", user.pw_uid, user.pw_gid)
    cloned = as_user(user, ["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], cwd=home,
                     timeout=120)
    assert cloned.returncode == 0, cloned.stderr
    script = clone / "scripts" / "setup.sh"
    shutil.copy(REPO / "scripts" / "setup.sh", script)  # the working tree's script, not only HEAD's
    os.chown(script, user.pw_uid, user.pw_gid)

    planned = as_user(user, ["bash", "scripts/setup.sh", "demo"], cwd=clone, timeout=60, MOPT_SETUP_DRY_RUN="1")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "dry run: nothing is changed (privileges: sudo -n)" in planned.stdout, planned.stdout
    assert not (clone / ".venv").exists()

    t0 = time.monotonic()
    result = as_user(user, ["bash", "scripts/setup.sh", "demo"], cwd=clone, timeout=600)
    took = time.monotonic() - t0
    print(f"setup.sh demo as {user.pw_name}: {took:.1f} s")
    if not group_access:
        assert result.returncode == 1, result.stdout + result.stderr
        assert f"give {user.pw_name} access through a docker group" in result.stderr, result.stderr
        assert not (clone / ".venv").exists()
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kept as it is" in result.stdout and "reachable (client" in result.stdout, result.stdout
    assert "venv: installed" in result.stdout and (clone / ".venv" / "bin" / "mopt").is_file(), result.stdout
    assert not_owned_by(user, clone) == []
    again = as_user(user, ["bash", "scripts/setup.sh", "demo"], cwd=clone, timeout=120)
    assert again.returncode == 0 and "venv: up to date (demo)" in again.stdout, again.stdout + again.stderr
    assert not_owned_by(user, home) == []


def _minimal_project(user) -> Path:
    """A checkout of USER's with only setup.sh and a small pyproject.toml, all the user's own."""
    project = Path(user.pw_dir) / "proj"
    (project / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", project / "scripts" / "setup.sh")
    (project / "pyproject.toml").write_text(PYPROJECT)
    for path in (project, project / "scripts", project / "scripts" / "setup.sh", project / "pyproject.toml"):
        os.chown(path, user.pw_uid, user.pw_gid)
    return project


@pytest.mark.timeout(120)
def test_a_user_without_the_docker_group_gets_one_line_with_the_fix(make_user):
    """A user outside the socket's group and without sudo rights: the dry run says sudo needs a
    password, the setup exits 1 with one line naming the fix (usermod -aG docker, or a docker group
    where the socket is root's), before any venv is made; no dockerd is started beside the running one."""
    _need_root_and_sudo()
    user = make_user(sudo=False, docker=False)
    project = _minimal_project(user)

    planned = as_user(user, ["bash", "scripts/setup.sh", "demo"], cwd=project, timeout=60,
                      MOPT_SETUP_DRY_RUN="1", MOPT_SKIP_APT="1")
    assert f"privileges: none: not root and 'sudo -n' needs a password for {user.pw_name}" in planned.stdout, (
        planned.stdout + planned.stderr)
    result = as_user(user, ["bash", "scripts/setup.sh", "demo"], cwd=project, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("[setup] ERROR")]
    assert len(errors) == 1 and f"docker: permission denied on {SOCKET}" in errors[0], result.stderr
    if SOCKET.group() == "docker":
        assert f"run 'sudo usermod -aG docker {user.pw_name}', log in again" in errors[0], errors[0]
    else:
        assert f"give {user.pw_name} access through a docker group" in errors[0], errors[0]
    assert "starting" not in result.stdout and not (project / ".venv").exists()


@pytest.mark.timeout(240)
def test_root_in_a_users_checkout_hands_what_it_made_back(make_user):
    """`sudo bash scripts/setup.sh` in a checkout that belongs to a user: the venv (and pip's
    egg-info) is made by root, then handed to the checkout's owner: nothing in it stays root's."""
    _need_root_and_sudo()
    user = make_user(sudo=False, docker=False)
    project = _minimal_project(user)
    result = setup(project, "demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"venv: handed to {user.pw_name}, the checkout's owner" in result.stdout, result.stdout
    assert not_owned_by(user, project) == []
    assert "handed" not in setup(project, "demo").stdout  # nothing of root's left: nothing to say


# --------------------------------------------------------------------------- OS detection
UBUNTU_2404 = """PRETTY_NAME="Ubuntu 24.04.1 LTS"
NAME="Ubuntu"
VERSION_ID="24.04"
VERSION_CODENAME=noble
ID=ubuntu
ID_LIKE=debian
"""
FEDORA_40 = """NAME="Fedora Linux"
VERSION_ID=40
ID=fedora
PRETTY_NAME="Fedora Linux 40 (Server Edition)"
"""


def detect(project: Path, os_release: str, *env: tuple[str, str]) -> subprocess.CompletedProcess:
    (project / "os-release").write_text(os_release)
    return subprocess.run(["bash", str(project / "scripts" / "setup.sh"), "test"],
                          env={**os.environ, "MOPT_OS_RELEASE": str(project / "os-release"),
                               "MOPT_SETUP_DRY_RUN": "1", **dict(env)},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_ubuntu_2404_is_detected_and_chromium_is_not_an_apt_package_there(project):
    """A fake os-release of Ubuntu 24.04 (dry run: nothing changes): supported, and Chromium is never
    among the packages to install (a chromium on PATH is used, else the line says it is skipped)."""
    result = detect(project, UBUNTU_2404)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[setup] OS: Ubuntu 24.04\n" in result.stdout
    assert "[setup] chromium: using " in result.stdout or "[setup] chromium: skipped on Ubuntu" in result.stdout
    assert not [ln for ln in result.stdout.splitlines() if "would install" in ln and "chromium" in ln]
    assert "dry run: done" in result.stdout and not (project / ".venv").exists()


@pytest.mark.timeout(120)
def test_an_unsupported_os_is_refused_in_one_line_unless_allowed(project):
    """Fedora 40 and Debian 11: exit 1 and one line naming the OS, the supported ones and the override,
    before anything else; with MOPT_ALLOW_UNSUPPORTED_OS=1 a warning and the run goes on."""
    result = detect(project, FEDORA_40)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr == ("[setup] ERROR: unsupported OS: Fedora Linux 40 (Server Edition) "
                             "(ID=fedora VERSION_ID=40); supported: Debian 12, Ubuntu 24.04; "
                             "set MOPT_ALLOW_UNSUPPORTED_OS=1 to try anyway with debian's package names\n")
    bullseye = detect(project, 'PRETTY_NAME="Debian GNU/Linux 11 (bullseye)"\nVERSION_ID="11"\nID=debian\n')
    assert bullseye.returncode == 1 and "unsupported OS: Debian GNU/Linux 11 (bullseye)" in bullseye.stderr
    allowed = detect(project, FEDORA_40, ("MOPT_ALLOW_UNSUPPORTED_OS", "1"))
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "OS: WARNING Fedora Linux 40 (Server Edition) is not supported" in allowed.stdout
    assert not (project / ".venv").exists()


# --------------------------------------------------------------------------- a docker client without its engine
DEBIAN_12 = 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nVERSION_ID="12"\nID=debian\n'


@pytest.mark.timeout(120)
def test_a_docker_client_without_a_daemon_gets_docker_io_beside_it(project, tmp_path):
    """A docker CLI copied onto a machine (as /usr/local/bin/docker here) with no daemon answering and no
    dockerd to start is not an engine: the dry run would install docker.io (where it is not installed
    yet). The same CLI with a dockerd on the machine is kept as it is, and docker.io is not installed."""
    assert not Path("/run/systemd/system").exists(), "this test expects no systemd (no docker.service to start)"
    client = tmp_path / "docker"
    client.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///nowhere.sock.' >&2\nexit 1\n")
    client.chmod(0o755)
    dockerd = tmp_path / "dockerd"
    dockerd.write_text("#!/bin/sh\nexit 1\n")
    dockerd.chmod(0o755)
    env = [("MOPT_DOCKER", str(client)), ("DOCKER_HOST", "")]
    alone = detect(project, DEBIAN_12, *env, ("MOPT_DOCKERD", str(tmp_path / "no-dockerd")))
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert f"docker: {client} is a client without a daemon (no dockerd here)" in alone.stdout, alone.stdout
    would = [ln for ln in alone.stdout.splitlines() if "would install" in ln]
    # (where an earlier setup installed docker.io already, nothing is left to install)
    assert (would and " docker.io " in f" {would[0]} ") or "system packages: all present" in alone.stdout
    with_engine = detect(project, DEBIAN_12, *env, ("MOPT_DOCKERD", str(dockerd)))
    assert with_engine.returncode == 0, with_engine.stdout + with_engine.stderr
    assert f"docker: {client} present: kept as it is" in with_engine.stdout, with_engine.stdout
    assert " docker.io " not in " ".join(ln for ln in with_engine.stdout.splitlines() if "would install" in ln)
