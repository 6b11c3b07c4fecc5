"""Pushing a local image to a registry.

copy_image, what publish uses: skopeo copies the image by its id from the daemon
(`docker-daemon:sha256:...`), so no tag on the shared daemon stands between the smoke test and the
registry and another process re-tagging a name cannot change what is pushed; the pushed manifest's
digest comes back in a file (--digestfile), not from scraped output. Missing blobs are uploaded again,
present ones skipped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..dockerclient import DockerCli, mask_secrets, run_docker, skopeo_daemon_host
from ..errors import PublishError

Log = Callable[[str], None]

# Output that means the credentials are missing or refused.
_AUTH_MARKERS = ("no basic auth credentials", "unauthorized", "denied", "authentication required",
                 "forbidden", "insufficient_scope", "incorrect username or password")


@dataclass(frozen=True)
class LocalImage:
    id: str
    repo_digests: tuple[str, ...]

    def digests_for(self, name: str) -> set[str]:
        return {d.split("@", 1)[1] for d in self.repo_digests if d.split("@", 1)[0] == name}


def inspect_image(docker: DockerCli, ref: str) -> LocalImage | None:
    res = run_docker(["image", "inspect", "--format", "{{json .}}", ref], docker=docker, check=False,
                     timeout=60)
    if res.returncode != 0:
        return None
    try:
        data = json.loads(res.stdout.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None
    return LocalImage(data.get("Id", ""), tuple(data.get("RepoDigests") or ()))


def _error_lines(output: str, n: int = 6) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:]) or "(no output)"


COPY_TIMEOUT_S = 3600.0
COPY_RETRIES = 2  # skopeo's own retries of transient registry errors


def copy_image(image_id: str, ref: str, config_dir: Path, *, insecure: bool, log: Log,
               redact: Iterable[str] = ()) -> str:
    """skopeo copy docker-daemon:IMAGE_ID docker://REF with the release's credentials file; the pushed
    manifest digest. Raises PublishError with skopeo's reason (credentials redacted)."""
    if not image_id.startswith("sha256:"):
        raise PublishError(f"{image_id!r} is not an image id (sha256:...): publish pushes by id")
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise PublishError("skopeo is not installed (scripts/setup.sh installs it; apt-get install skopeo): "
                           "publish copies images by id with it")
    with tempfile.TemporaryDirectory(prefix="mopt-push-") as tmp:
        digest_file = Path(tmp) / "digest"
        argv = [skopeo, "copy", "--quiet", "--retry-times", str(COPY_RETRIES), "--digestfile", str(digest_file),
                "--dest-authfile", str(config_dir / "config.json"), f"--dest-tls-verify={str(not insecure).lower()}",
                *skopeo_daemon_host("src"), f"docker-daemon:{image_id}", f"docker://{ref}"]
        env = dict(os.environ)
        if insecure:  # a loopback registry: never through an environment proxy
            env["NO_PROXY"] = env["no_proxy"] = ",".join(filter(None, [env.get("NO_PROXY", ""), ref.split("/")[0]]))
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=COPY_TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired:
            raise PublishError(f"copying {image_id[:19]} to {ref} took over {COPY_TIMEOUT_S:.0f} s") from None
        detail = mask_secrets(_error_lines(res.stderr or res.stdout), [s for s in redact if s])
        if res.returncode != 0:
            hint = ""
            if any(marker in (res.stderr or "").lower() for marker in _AUTH_MARKERS):
                hint = f"; check `docker login {ref.split('/', 1)[0]}` in {config_dir}"
            raise PublishError(f"copying image {image_id[:19]} to {ref} failed: {detail}{hint}")
        digest = digest_file.read_text().strip() if digest_file.is_file() else ""
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise PublishError(f"copying image {image_id[:19]} to {ref} reported no manifest digest ({digest!r})")
    log(f"    pushed {ref} from image {image_id[:19]}: {digest}")
    return digest
