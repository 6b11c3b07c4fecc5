"""A real, authenticated OCI registry on 127.0.0.1 for the demo and the integration tests.

It runs Debian's ``docker-registry`` (CNCF distribution 2.8) with filesystem storage and
htpasswd (bcrypt) authentication. Docker treats 127.0.0.0/8 as an insecure-allowed registry,
so push/pull work over plain HTTP after ``docker login``.

Passwords never appear on a command line or in a log: ``docker_login`` feeds the password to
``docker login --password-stdin`` or writes the auth entry straight into a config.json (0600).
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from .dockerclient import DockerCli, run_docker
from .errors import EnvironmentProblem, PublishError

REGISTRY_BINARIES = ("docker-registry", "registry")
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _no_proxy_opener(auth: tuple[str, str] | None = None) -> urllib.request.OpenerDirector:
    # Never send loopback requests through an HTTP(S)_PROXY from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        opener.addheaders = [("Authorization", f"Basic {token}")]
    return opener


def _v2_status(address: str, auth: tuple[str, str] | None = None, timeout: float = 2.0) -> int | None:
    """HTTP status of GET http://ADDRESS/v2/, or None when nothing answers."""
    try:
        with _no_proxy_opener(auth).open(f"http://{address}/v2/", timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def find_registry_binary() -> str:
    for name in REGISTRY_BINARIES:
        path = shutil.which(name)
        if path:
            return path
    raise EnvironmentProblem(
        "the `docker-registry` program (CNCF distribution) is not installed; "
        "install it with `apt-get install docker-registry` (or run scripts/setup.sh)"
    )


class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1 with htpasswd auth and filesystem storage.

    Files under ``root_dir``: ``config.yml``, ``htpasswd``, ``data/`` (storage) and
    ``registry.log``. ``port=0`` picks a free port. ``password=None`` generates a random one
    (read it from ``.password``). Use as a context manager or call start()/stop().
    """

    def __init__(self, root_dir: str | os.PathLike[str], port: int = 0, user: str = "mopt",
                 password: str | None = None):
        self.root_dir = Path(root_dir).resolve()
        self._requested_port = int(port)
        self.port = int(port)
        self.user = user
        self.password = password if password is not None else secrets.token_urlsafe(18)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None

    # ---------------------------------------------------------------- properties
    @property
    def address(self) -> str:
        """host:port, as used in image references (``127.0.0.1:PORT/repo:tag``)."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def config_path(self) -> Path:
        return self.root_dir / "config.yml"

    @property
    def htpasswd_path(self) -> Path:
        return self.root_dir / "htpasswd"

    @property
    def data_dir(self) -> Path:
        return self.root_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.root_dir / "registry.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:  # no password
        return f"LocalRegistry(address={self.address!r}, user={self.user!r}, running={self.running})"

    # ---------------------------------------------------------------- files
    def _write_htpasswd(self) -> None:
        import bcrypt  # test/runtime dependency; only needed when a registry is started

        hashed = bcrypt.hashpw(self.password.encode(), bcrypt.gensalt(rounds=10)).decode()
        self.htpasswd_path.write_text(f"{self.user}:{hashed}\n")
        self.htpasswd_path.chmod(0o600)

    def _write_config(self) -> None:
        # JSON is valid YAML: no YAML writer needed, and no quoting surprises.
        config = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "fields": {"service": "mopt-registry"}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.data_dir)},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {
                "addr": self.address,
                "secret": secrets.token_hex(16),
                "headers": {"X-Content-Type-Options": ["nosniff"]},
            },
            "auth": {"htpasswd": {"realm": "mopt-local-registry", "path": str(self.htpasswd_path)}},
        }
        self.config_path.write_text(json.dumps(config, indent=2) + "\n")
        self.config_path.chmod(0o600)

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout: float = START_TIMEOUT_S) -> LocalRegistry:
        if self.running:
            return self
        binary = find_registry_binary()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(exist_ok=True)
        self._write_htpasswd()
        attempts = 3 if self._requested_port == 0 else 1
        last_problem = ""
        if self._requested_port and not _port_free(self._requested_port):
            # Checked first: another server on that port would answer the readiness probe for us.
            raise EnvironmentProblem(f"local registry cannot listen on 127.0.0.1:{self._requested_port}: "
                                     "address already in use")
        for _ in range(attempts):
            self.port = self._requested_port or _free_port()
            self._write_config()
            self._log_file = open(self.log_path, "ab")  # closed in stop()
            env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}
            self._proc = subprocess.Popen([binary, "serve", str(self.config_path)],
                                          stdout=self._log_file, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            problem = self._wait_ready(timeout)
            if problem is None:
                return self
            last_problem = problem
            self.stop()
            if "address already in use" not in problem:
                break
        raise EnvironmentProblem(f"local registry did not start on {self.address}: {last_problem}\n"
                                 f"(log: {self.log_path})")

    def _wait_ready(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                return f"docker-registry exited with code {self._proc.returncode}: {self._log_tail()}"
            status = _v2_status(self.address, timeout=1.0)
            if status == 401:
                return None
            if status is not None:
                return f"GET /v2/ answered {status}, expected 401 (is another server on that port?)"
            time.sleep(0.1)
        return f"no answer on /v2/ within {timeout:.0f}s: {self._log_tail()}"

    def _log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def detach(self) -> int:
        """Leave the registry serving after this process exits (the demo does); returns its pid."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            raise EnvironmentProblem(f"local registry on {self.address} is not running")
        (self.root_dir / "registry.pid").write_text(f"{proc.pid}\n")
        return proc.pid

    def __enter__(self) -> LocalRegistry:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __del__(self) -> None:  # best effort: never leave a registry process behind
        try:
            self.stop(timeout=2.0)
        except Exception:
            pass

    # ---------------------------------------------------------------- helpers
    def check_credentials(self, user: str | None = None, password: str | None = None) -> bool:
        """True when GET /v2/ with these (default: this registry's) credentials answers 200."""
        status = _v2_status(self.address, (user or self.user,
                                           self.password if password is None else password))
        return status == 200

    def login(self, config_dir: str | os.PathLike[str] | None = None, *, use_cli: bool | None = None,
              docker: DockerCli | None = None) -> Path:
        """docker_login() into this registry with its own credentials."""
        return docker_login(self.address, self.user, self.password, config_dir=config_dir,
                            use_cli=use_cli, docker=docker)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def docker_login(address: str, user: str, password: str,
                 config_dir: str | os.PathLike[str] | None = None, *,
                 use_cli: bool | None = None, docker: DockerCli | None = None) -> Path:
    """Store credentials for ``address`` in a docker config.json; return that file's path.

    - ``config_dir=None``: ``docker login --password-stdin`` into the user's default config.
    - ``config_dir`` given: the auth entry is written directly into ``config_dir/config.json``
      (created 0600, other entries kept), unless ``use_cli=True`` or that config names a
      ``credsStore`` (then docker would ignore plain entries, so the CLI is used with
      DOCKER_CONFIG=config_dir). Direct writes to a loopback registry are verified with one
      authenticated GET /v2/.
    The password goes only through stdin or the file, never argv or a log.
    """
    if config_dir is None:
        cfg_dir = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
        use_cli = True
    else:
        cfg_dir = Path(config_dir)
    cfg_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = cfg_dir / "config.json"

    existing: dict = {}
    if cfg_path.exists():
        try:
            existing = json.loads(cfg_path.read_text() or "{}")
        except json.JSONDecodeError as exc:
            raise EnvironmentProblem(f"{cfg_path} is not valid JSON: {exc}") from exc
    if existing.get("credsStore") or address in existing.get("credHelpers", {}):
        use_cli = True

    if use_cli:
        run_docker(["login", "--username", user, "--password-stdin", address], docker=docker,
                   input=password, env={"DOCKER_CONFIG": str(cfg_dir)}, redact=[password],
                   error_cls=PublishError, timeout=60)
        return cfg_path

    if _is_loopback(address) and _v2_status(address, (user, password)) not in (200, None):
        raise PublishError(f"registry {address} rejected the credentials for user {user!r}")
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    existing.setdefault("auths", {})[address] = {"auth": auth}
    tmp = cfg_path.with_name(f".config.json.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(existing, f, indent=2)
        f.write("\n")
    os.replace(tmp, cfg_path)
    return cfg_path


__all__ = ["LocalRegistry", "docker_login", "find_registry_binary"]
