"""The registry client's parts that need no Docker: registry references, docker push output, the HTTP
API's Bearer-token flow and retries (against a tiny in-process fake registry on loopback), credentials
from docker's config."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from builder.errors import ConfigError, PublishError
from builder.registry import api as api_mod
from builder.registry.api import MANIFEST_TYPES, RegistryApi
from builder.registry.credentials import Credentials, docker_config_dir, load_credentials
from builder.registry.reference import Registry


# --------------------------------------------------------------------------- Registry.parse
@pytest.mark.parametrize("text, host, namespace", [
    ("127.0.0.1:5000", "127.0.0.1:5000", None),
    ("127.0.0.1:5000/team", "127.0.0.1:5000", "team"),
    ("localhost/team/sub", "localhost", "team/sub"),
    ("ghcr.io/acme", "ghcr.io", "acme"),
    ("Registry.Example.com:443/a-b_c.d/", "registry.example.com:443", "a-b_c.d"),
    ("[::1]:5000/x", "[::1]:5000", "x"),
])
def test_registry_parse_accepts(text, host, namespace):
    reg = Registry.parse(text)
    assert (reg.host, reg.namespace) == (host, namespace)


@pytest.mark.parametrize("text, why", [
    ("", "empty"),
    ("   ", "empty"),
    ("http://127.0.0.1:5000", "scheme"),
    ("127.0.0.1:5000/Team", "namespace"),
    ("127.0.0.1:5000/team//x", "namespace"),
    ("127.0.0.1:notaport", "port"),
    ("127.0.0.1:0", "port"),
    ("127.0.0.1:70000", "port"),
    ("127.0.0.1:", "empty port"),
    ("team", "Docker Hub namespace"),
    ("my registry:5000", "whitespace"),
    ("127.0.0.1:5000/team/img@sha256:abc", "'@'"),
    ("-bad-.example.com", "not a valid host"),
    ("127.0.0.1:5000/team:tag", "namespace"),
])
def test_registry_parse_rejects_junk(text, why):
    with pytest.raises(ConfigError) as exc:
        Registry.parse(text)
    assert exc.value.exit_code == 2 and why in str(exc.value)


def test_registry_reference():
    assert Registry.parse("127.0.0.1:5000/team").reference("mopt/minilm-embed", "1.0") == \
        "127.0.0.1:5000/team/minilm-embed:1.0"
    assert Registry.parse("127.0.0.1:5000").reference("mopt/minilm-embed", "1.0") == \
        "127.0.0.1:5000/mopt/minilm-embed:1.0"
    with pytest.raises(ConfigError):
        Registry.parse("127.0.0.1:5000").reference("mopt/minilm-embed", "bad tag")


# --------------------------------------------------------------------------- Bearer flow (fake registry)
class _FakeTokenRegistry(BaseHTTPRequestHandler):
    """/v2/ with Bearer auth (token from /token with basic auth), one manifest, its blobs, one 503."""

    state: dict = {}

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        st = self.state
        if self.path.startswith("/token"):
            expected = "Basic " + base64.b64encode(b"bob:pw").decode()
            st["token_requests"].append(self.path)
            if self.headers.get("Authorization") != expected:
                return self._send(401)
            return self._send(200, json.dumps({"token": "tok123"}).encode(),
                              {"Content-Type": "application/json"})
        if self.headers.get("Authorization") != "Bearer tok123":
            realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
            return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="{realm}",service="fake",'
                                                                 f'scope="repository:team/tiny:pull"'})
        if self.path == "/v2/team/tiny/manifests/1.0":
            if st["fail_next"]:
                st["fail_next"] -= 1
                return self._send(503)
            return self._send(200, st["manifest"], {"Content-Type": MANIFEST_TYPES[3],
                                                    "Docker-Content-Digest": st["digest"]})
        if self.path.startswith("/v2/team/tiny/blobs/"):
            digest = self.path.rsplit("/", 1)[1]
            if digest in st["blobs"]:
                return self._send(200, b"x" * st["blobs"][digest])
        return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')

    do_HEAD = do_GET


def test_bearer_token_flow_and_http_retries(monkeypatch):
    monkeypatch.setattr(api_mod, "HTTP_WAIT_MULTIPLIER_S", 0.01)
    cfg, layer = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_TYPES[3],
                           "config": {"mediaType": "x", "size": 10, "digest": cfg},
                           "layers": [{"mediaType": "y", "size": 20, "digest": layer}]}).encode()
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    _FakeTokenRegistry.state = {"manifest": manifest, "digest": digest, "blobs": {cfg: 10, layer: 20},
                                "fail_next": 2, "token_requests": []}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeTokenRegistry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reg = Registry.parse(f"127.0.0.1:{server.server_address[1]}/team")
        api = RegistryApi(reg, Credentials("test", "bob", "pw"), scheme="http")
        m = api.verify("team/tiny", "1.0", digest)  # two 503s are retried, then the token flow
        assert m.digest == digest
        assert _FakeTokenRegistry.state["fail_next"] == 0
        assert len(_FakeTokenRegistry.state["token_requests"]) == 1  # token cached per scope
        assert "scope=repository%3Ateam%2Ftiny%3Apull" in _FakeTokenRegistry.state["token_requests"][0]
        assert api.manifest("team/tiny", "nope") is None
        del _FakeTokenRegistry.state["blobs"][layer]
        with pytest.raises(PublishError, match="is missing"):
            api.verify("team/tiny", "1.0", digest)
        bad = RegistryApi(reg, Credentials("test", "bob", "wrong"), scheme="http")
        with pytest.raises(PublishError, match="rejected the credentials") as exc:
            bad.manifest("team/tiny", "1.0")
        assert "wrong" not in str(exc.value)
        nocreds = RegistryApi(reg, None, scheme="http", config_dir=Path("/nonexistent"))
        with pytest.raises(PublishError, match="no credentials for registry"):
            nocreds.manifest("team/tiny", "1.0")
    finally:
        server.shutdown()
        server.server_close()


def test_credentials_come_from_docker_config_env(monkeypatch, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    auth = base64.b64encode(b"alice:pw:with:colons").decode()
    (cfg / "config.json").write_text(json.dumps({"auths": {"https://reg.example.com:5000": {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    reg = Registry.parse("reg.example.com:5000")
    creds = load_credentials(reg, docker_config_dir())
    assert creds is not None and (creds.username, creds.password) == ("alice", "pw:with:colons")
    assert "pw:with" not in repr(creds)
    assert load_credentials(Registry.parse("other.example.com"), cfg) is None
    assert os.environ["DOCKER_CONFIG"] == str(cfg)


# --------------------------------------------------------------------------- the whole messages
SHAPE = "expected HOST[:PORT][/NAMESPACE]"


@pytest.mark.parametrize("text, message", [
    ("", f"registry is empty; {SHAPE}, e.g. 127.0.0.1:5000/team"),
    (5, f"registry is empty; {SHAPE}, e.g. 127.0.0.1:5000/team"),  # not a string at all
    ("http://127.0.0.1:5000", f"registry 'http://127.0.0.1:5000' must not have a scheme; {SHAPE}"),
    ("my registry:5000", f"registry 'my registry:5000' contains whitespace or '@'; {SHAPE}"),
    ("a@b", f"registry 'a@b' contains whitespace or '@'; {SHAPE}"),
    ("[::1", "registry '[::1': bad bracketed IPv6 host '[::1'"),
    ("[zz]:5000", "registry '[zz]:5000': bad bracketed IPv6 host '[zz]:5000'"),
    ("127.0.0.1:", "registry '127.0.0.1:': empty port after ':'"),
    ("-bad-.example.com", "registry '-bad-.example.com': '-bad-.example.com' is not a valid host name or address"),
    ("127.0.0.1:0", "registry '127.0.0.1:0': port '0' is not a number in 1..65535"),
    ("127.0.0.1:65536", "registry '127.0.0.1:65536': port '65536' is not a number in 1..65535"),
    ("127.0.0.1:x1", "registry '127.0.0.1:x1': port 'x1' is not a number in 1..65535"),
    ("[::1]:70000", "registry '[::1]:70000': port '70000' is not a number in 1..65535"),
    ("team", "registry 'team': 'team' does not look like a registry host (no '.', no port, not 'localhost'); "
             "docker would read it as a Docker Hub namespace. Write docker.io/team for Docker Hub, or HOST:PORT "
             "for a registry"),
    ("127.0.0.1:5000/Team", "registry '127.0.0.1:5000/Team': namespace 'Team' is invalid (lowercase letters, "
                            "digits and separators '.', '_', '-', components joined by '/')"),
])
def test_registry_parse_messages(text, message):
    with pytest.raises(ConfigError) as exc:
        Registry.parse(text)
    assert exc.value.key == "registry" and exc.value.message == f"registry: {message}"


@pytest.mark.parametrize("text, host, namespace, shown", [
    ("127.0.0.1:1", "127.0.0.1:1", None, "127.0.0.1:1"),
    ("127.0.0.1:65535/a/", "127.0.0.1:65535", "a", "127.0.0.1:65535/a"),
    ("[::ABCD]:5000/t", "[::ABCD]:5000", "t", "[::ABCD]:5000/t"),  # IPv6 hex in either case, kept as written
    ("[fe80::1]", "[fe80::1]", None, "[fe80::1]"),
    ("Reg.Example.COM", "reg.example.com", None, "reg.example.com"),
    ("reg.example.X/", "reg.example.x", None, "reg.example.x"),  # only the trailing '/' is stripped
])
def test_registry_parse_edges(text, host, namespace, shown):
    reg = Registry.parse(text)
    assert (reg.host, reg.namespace, str(reg)) == (host, namespace, shown)


def test_repository_paths_and_references():
    plain, team = Registry.parse("127.0.0.1:5000"), Registry.parse("127.0.0.1:5000/team")
    assert plain.repository_path("/mopt/sub/x/") == "mopt/sub/x"
    assert team.repository_path("/mopt/sub/x/") == "team/x"  # the namespace replaces every planned component
    assert team.repository_path("x") == "team/x" and plain.repository_path("x") == "x"
    for bad in ("", "Bad/X", "a//b"):
        with pytest.raises(ConfigError) as exc:
            plain.repository_path(bad)
        assert exc.value.message == f"repository: repository {bad!r} is not a valid image repository name"
    for bad in ("", None, "bad tag", "-x"):
        with pytest.raises(ConfigError) as exc:
            plain.reference("mopt/x", bad)
        assert exc.value.message == f"tag: tag {bad!r} is not a valid docker tag"
    assert plain.reference("mopt/x", "A_1.2-b") == "127.0.0.1:5000/mopt/x:A_1.2-b"


@pytest.mark.parametrize("host, loopback", [
    ("localhost", True), ("localhost:5000", True), ("127.0.0.1", True), ("127.9.8.7:80", True),
    ("[::1]", True), ("[::1]:5000", True), ("example.com", False), ("10.0.0.1:5000", False),
    ("[::2]:1", False), ("localhost.example.com", False), ("x127.0.0.1", False),
])
def test_loopback_hosts(host, loopback):
    from builder.registry.reference import is_loopback_host

    assert is_loopback_host(host) is loopback
    assert Registry(host=host, namespace=None).is_loopback is loopback
    assert Registry(host="docker.io", namespace=None).api_host == "registry-1.docker.io"
    assert Registry(host=host, namespace=None).api_host == host
