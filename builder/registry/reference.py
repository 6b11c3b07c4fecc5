"""Where images go: a registry host with an optional namespace, and the references made from it.

`--registry HOST[:PORT][/NAMESPACE]` is parsed strictly (ConfigError, exit 2): a value docker would
silently read as a Docker Hub namespace is refused, and the namespace replaces the planned one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

DOCKER_HUB_HOSTS = ("docker.io", "index.docker.io", "registry-1.docker.io")
DOCKER_HUB_AUTH_KEY = "https://index.docker.io/v1/"

_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAMESPACE_RE = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*$")


def is_loopback_host(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    return name in ("localhost", "[::1]") or name.startswith("127.")


@dataclass(frozen=True)
class Registry:
    host: str  # "127.0.0.1:5000"
    namespace: str | None  # "team" from "127.0.0.1:5000/team" (replaces the planned namespace)

    @classmethod
    def parse(cls, text: str) -> Registry:
        """Parse ``HOST[:PORT][/NAMESPACE]``; raise ConfigError (exit 2) on anything else."""
        raw = text if isinstance(text, str) else ""
        value = raw.strip()
        if not value:
            raise ConfigError("registry is empty; expected HOST[:PORT][/NAMESPACE], e.g. 127.0.0.1:5000/team",
                              key="registry")
        if "://" in value:
            raise ConfigError(f"registry {raw!r} must not have a scheme; expected HOST[:PORT][/NAMESPACE]",
                              key="registry")
        if any(c.isspace() for c in value) or "@" in value:
            raise ConfigError(f"registry {raw!r} contains whitespace or '@'; expected "
                              "HOST[:PORT][/NAMESPACE]", key="registry")
        host, _, namespace = value.rstrip("/").partition("/")
        if host.startswith("["):  # [IPv6]:port
            m = re.fullmatch(r"\[([0-9A-Fa-f:]+)\](?::(\d+))?", host)
            if not m:
                raise ConfigError(f"registry {raw!r}: bad bracketed IPv6 host {host!r}", key="registry")
            port = m.group(2)
            name = m.group(1)
        else:
            name, sep, port = host.partition(":")
            if sep and not port:
                raise ConfigError(f"registry {raw!r}: empty port after ':'", key="registry")
            if not _HOSTNAME_RE.match(name):
                raise ConfigError(f"registry {raw!r}: {name!r} is not a valid host name or address",
                                  key="registry")
        if port is not None and port != "":
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"registry {raw!r}: port {port!r} is not a number in 1..65535",
                                  key="registry")
        # Docker reads the first path component as a registry host only if it has a '.' or ':' or
        # is 'localhost'; anything else would silently mean Docker Hub.
        if not (port or "." in name or name == "localhost" or host.startswith("[")):
            raise ConfigError(
                f"registry {raw!r}: {name!r} does not look like a registry host (no '.', no port, not "
                "'localhost'); docker would read it as a Docker Hub namespace. Write docker.io/"
                f"{value} for Docker Hub, or HOST:PORT for a registry",
                key="registry")
        if namespace and not _NAMESPACE_RE.match(namespace):
            raise ConfigError(
                f"registry {raw!r}: namespace {namespace!r} is invalid (lowercase letters, digits and "
                "separators '.', '_', '-', components joined by '/')", key="registry")
        return cls(host=host.lower() if not host.startswith("[") else host, namespace=namespace or None)

    def repository_path(self, repository: str) -> str:
        """The repository's path inside this registry (namespace replaced when one is set)."""
        repository = repository.strip("/")
        if not repository or not _NAMESPACE_RE.match(repository):
            raise ConfigError(f"repository {repository!r} is not a valid image repository name",
                              key="repository")
        image = repository.rsplit("/", 1)[-1]
        if self.namespace:
            return f"{self.namespace}/{image}"
        return repository

    def reference(self, repository: str, tag: str) -> str:
        """``host/namespace-or-planned/image:tag``."""
        if not _TAG_RE.match(tag or ""):
            raise ConfigError(f"tag {tag!r} is not a valid docker tag", key="tag")
        return f"{self.host}/{self.repository_path(repository)}:{tag}"

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}" if self.namespace else self.host

    # ---- where the API lives and which config.json key holds its credentials
    @property
    def api_host(self) -> str:
        return "registry-1.docker.io" if self.host in DOCKER_HUB_HOSTS else self.host

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)
