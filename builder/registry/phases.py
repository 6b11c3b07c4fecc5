"""Publish smoke-tested images as one release: every immutable long tag first, verified, then the short tags.

0. plan: for every item, ask the registry (HTTP API) what its long tag points at now. A long tag that
   already points at another image refuses the whole release before anything is pushed (long tags are
   immutable). The same image is recognised by the local image's RepoDigest for that repository, or a
   manifest whose config digest is the local image id. The dry run and the real run share this plan;
   the dry run stops after logging what each phase would do.
1. for every item: copy the smoke-tested image BY ITS ID to the long ref (push.copy_image: no local
   tag involved, so a concurrent re-tag on the shared daemon cannot change what is pushed), or skip it
   when the registry already holds this image there; then verify it: the manifest digest is the pushed
   one (header and body hash), its config digest is the tested image id (the identity check), and
   every blob and child manifest it references is present. A long tag that holds this image with a
   blob missing is repaired: the copy uploads what is missing.
2. only once EVERY long tag of the release is verified, move each short tag: compare (nothing to do
   when it already points at the verified digest), then move it by putting the verified manifest's
   own bytes under it through the registry API (no push: the short tag can only name that digest),
   then verify it the same way.

A failure in phases 0-1 leaves every short tag where it was, so users pulling a short tag never see
half a release; a re-run skips the long tags already verified.

Across machines (a release fanned out over CI runners): each runner publishes its variants with
long_only=True, stopping after phase 1, and keeps a LongTagRecord per variant; one job then calls
promote() with every record of the release, which needs no local image: it checks a record exists for
every planned variant, verifies every long tag again against its record (digest, blobs, config = the
tested image id), and only then runs phase 2.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..dockerclient import DockerCli, find_docker
from ..errors import PublishError
from .api import Manifest, RegistryApi, config_digests
from .credentials import docker_config_dir, load_credentials
from .push import LocalImage, copy_image, inspect_image
from .reference import Registry

Log = Callable[[str], None]


@dataclass(frozen=True)
class PublishItem:
    variant_id: str  # e.g. "minilm-embed:cpu"
    image_id: str  # local image id (sha256:...) that passed its smoke test
    repository: str  # e.g. "mopt/minilm-embed" (namespace/image as planned)
    long_tag: str  # immutable tag, pushed first
    short_tag: str  # moving tag, pushed only after the long tag is verified


@dataclass(frozen=True)
class PublishResult:
    variant_id: str
    references: tuple[str, ...]  # pushed refs, long first
    digest: str  # manifest digest verified in the registry
    skipped: bool  # True when the registry already had this exact image at the long tag


@dataclass(frozen=True)
class Refs:
    repo: str  # path in the registry, e.g. team/minilm-embed
    name: str  # host/repo, how RepoDigests name it
    long: str  # host/repo:long_tag
    short: str  # host/repo:short_tag


@dataclass(frozen=True)
class PlannedItem:
    """Phase 0's view of one item: its local image and what its long tag holds in the registry now."""

    item: PublishItem
    refs: Refs
    local: LocalImage | None  # None when the item could not be checked (then error says why)
    remote_long: Manifest | None  # the long tag's manifest now; None when the tag is free
    same_image: bool  # the long tag already holds this image (skip its push)
    error: PublishError | None  # why this item cannot be published, found before anything is pushed


def refs(item: PublishItem, registry: Registry) -> Refs:
    repo = registry.repository_path(item.repository)
    return Refs(repo=repo, name=f"{registry.host}/{repo}", long=registry.reference(item.repository, item.long_tag),
                short=registry.reference(item.repository, item.short_tag))


@dataclass(frozen=True)
class LongTagRecord:
    """What a runner's long-only publish leaves for the release's promote job."""

    variant_id: str
    image_id: str  # the smoke-tested image: the long tag's config digest
    repository: str
    long_tag: str
    short_tag: str
    registry: str  # as given to --registry
    digest: str  # the verified manifest digest of the long tag

    FIELDS = ("variant_id", "image_id", "repository", "long_tag", "short_tag", "registry", "digest")

    def to_json(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_json(cls, data: object, where: str) -> LongTagRecord:
        if not isinstance(data, dict) or set(data) != set(cls.FIELDS) or \
                not all(isinstance(data[k], str) and data[k] for k in cls.FIELDS):
            raise PublishError(f"{where}: not a long-tag record (expected the keys {', '.join(cls.FIELDS)})")
        return cls(**{k: data[k] for k in cls.FIELDS})

    def item(self) -> PublishItem:
        return PublishItem(self.variant_id, self.image_id, self.repository, self.long_tag, self.short_tag)


AfterLong = Callable[[PublishItem, "Refs", str, RegistryApi], None]  # (item, refs, verified digest, api)


def publish(items: Iterable[PublishItem], registry: Registry, *, docker_config: str | None = None,
            dry_run: bool = False, log: Log = print, docker: DockerCli | None = None,
            long_only: bool = False, after_long: AfterLong | None = None) -> list[PublishResult]:
    """Publish a release in phases (see the module doc). Raises PublishError (exit 6) at the first failure;
    its `failed` names the variant, `published` the results whose short tag moved (empty when phase 1
    failed), `long_verified` the long tags in the registry and verified, which a re-run skips.
    `dry_run` changes nothing, logs what would move (long tags first, then short tags), and raises at the
    end if the real run would be refused. `long_only` stops after phase 1 (promote() moves the short tags).
    `after_long` runs for every item once all long tags are verified and before any short tag moves
    (signing: a short tag never names an image without its attestations)."""
    items = list(items)
    seen: dict[tuple[str, str], str] = {}
    for item in items:
        for tag in (item.long_tag, item.short_tag):
            key = (registry.repository_path(item.repository), tag)
            if key in seen and seen[key] != item.variant_id:
                raise PublishError(f"{item.variant_id} and {seen[key]} would both publish {key[0]}:{tag}")
            seen[key] = item.variant_id
    config_dir = docker_config_dir(docker_config)
    creds = load_credentials(registry, config_dir)
    api = RegistryApi(registry, creds, config_dir=config_dir)
    secrets = creds.secrets if creds else []
    cli = docker or find_docker()
    try:
        # The dry run lists every problem; the real run stops planning at the first (a down registry
        # then fails in one item's retries, not in every item's).
        planned = plan(items, registry, api, cli, stop_at_first_error=not dry_run)
        if dry_run:
            return _dry_run(planned, api, log)
        return _publish(planned, api, config_dir, secrets, log, long_only, after_long)
    finally:
        api.close()


def promote(records: Iterable[LongTagRecord], expected: Iterable[str], registry: Registry, *,
            docker_config: str | None = None, log: Log = print,
            check_signed: Callable[[RegistryApi, Refs, str], None] | None = None) -> list[PublishResult]:
    """The fan-in of a distributed release: phase 2 for long tags published elsewhere. EXPECTED names
    every variant of the release; one without a record (its job failed or never published) stops the
    release with no short tag moved, as does a long tag that no longer verifies against its record, or
    (CHECK_SIGNED, where signing is configured) one whose signatures do not verify."""
    records = list(records)
    by_id = {r.variant_id: r for r in records}
    missing = [v for v in expected if v not in by_id]
    if missing:
        raise PublishError(f"no long-tag record for {', '.join(missing)} (its job failed or did not publish); "
                           "no short tag was moved")
    elsewhere = sorted({r.registry for r in records} - {str(registry)})
    if elsewhere:
        raise PublishError(f"records name registry {', '.join(elsewhere)}, not {registry}; no short tag was moved")
    config_dir = docker_config_dir(docker_config)
    api = RegistryApi(registry, load_credentials(registry, config_dir), config_dir=config_dir)
    try:
        planned = [PlannedItem(item=r.item(), refs=refs(r.item(), registry), local=LocalImage(r.image_id, ()),
                               remote_long=None, same_image=True, error=None) for r in records]
        checked: list[str] = []
        for p, record in zip(planned, records, strict=True):  # every long tag, before any short tag
            try:
                verify_identity(api, p, record.long_tag, record.digest)
                if check_signed is not None:
                    check_signed(api, p.refs, record.long_tag)
            except PublishError as exc:
                raise fail(exc, p.item, [], checked, moving_short_tags=False) from None
            log(f"  verified {p.refs.long} = {record.digest} (image {record.image_id[:19]}"
                + (", signatures verified)" if check_signed is not None else ")"))
            checked.append(p.refs.long)
        log(f"all {len(checked)} long tags of the release verified; moving the short tags")
        results: list[PublishResult] = []
        for p, record in zip(planned, records, strict=True):
            pushed: list[str] = []
            try:
                _short_tag(p, record.digest, api, log, pushed)
            except PublishError as exc:
                raise fail(exc, p.item, results, [], moving_short_tags=True) from None
            log(f"  verified {p.refs.short} = {record.digest}")
            results.append(PublishResult(p.item.variant_id, tuple(pushed), record.digest, not pushed))
        return results
    finally:
        api.close()


def plan(items: list[PublishItem], registry: Registry, api: RegistryApi, cli: DockerCli, *,
         stop_at_first_error: bool = False) -> list[PlannedItem]:
    """Phase 0, nothing changed: the local image and what its long tag holds now, for every item (or
    up to the first that cannot be published)."""
    planned = []
    for item in items:
        item_refs = refs(item, registry)
        try:
            local = local_image(cli, item)
            remote = api.manifest(item_refs.repo, item.long_tag)
            same = remote is not None and same_image(api, item_refs.repo, remote, local, item_refs.name)
            error = immutable_refusal(item_refs.long, remote, local) if remote is not None and not same else None
        except PublishError as exc:  # the item cannot be checked: nothing about it is known
            local, remote, same, error = None, None, False, exc
        planned.append(PlannedItem(item=item, refs=item_refs, local=local, remote_long=remote, same_image=same,
                                   error=error))
        if error is not None and stop_at_first_error:
            break
    return planned


def same_image(api: RegistryApi, repo: str, remote: Manifest, local: LocalImage, name: str) -> bool:
    """Whether the registry's manifest is the local image: a RepoDigest match, else the same config."""
    if remote.digest in local.digests_for(name):
        return True
    return local.id in config_digests(api, repo, remote)


def local_image(cli: DockerCli, item: PublishItem) -> LocalImage:
    local = inspect_image(cli, item.image_id)
    if local is None:
        raise PublishError(f"local image {item.image_id} not found (was it removed after its smoke test?)")
    if item.image_id.startswith("sha256:") and local.id != item.image_id:
        raise PublishError(f"{item.image_id} resolves to image {local.id}, not the smoke-tested one")
    return local


def immutable_refusal(long_ref: str, remote: Manifest, local: LocalImage) -> PublishError:
    return PublishError(
        f"{long_ref} already points at {remote.digest} in the registry, which is not local image {local.id}; "
        "long tags are immutable and will not be moved (bump the version, or delete the tag from the registry "
        "deliberately)")


def fail(exc: PublishError, item: PublishItem, published: list[PublishResult], long_verified: list[str], *,
         moving_short_tags: bool) -> PublishError:
    """The release's error: the variant that failed and what the failure left moved or verified."""
    note = ""
    if not moving_short_tags:
        note = "\n(no short tag was moved"
        note += f"; verified long tags a re-run will skip: {', '.join(long_verified)})" if long_verified else ")"
    elif published:
        note = f"\n(short tags already moved: {', '.join(r.variant_id for r in published)})"
    exc.message = f"{item.variant_id}: {exc.message}{note}"
    exc.args = (exc.message,)
    exc.failed = item.variant_id
    exc.published = list(published)
    exc.long_verified = list(long_verified)
    return exc


def _dry_run(planned: list[PlannedItem], api: RegistryApi, log: Log) -> list[PublishResult]:
    problems: list[str] = []
    log("[dry-run] phase 1: immutable long tags (pushed and verified first)")
    for p in planned:
        if p.local is None:
            problems.append(f"{p.item.variant_id}: {p.error}")
            log(f"  {p.item.variant_id}: cannot check: {p.error}")
        elif p.remote_long is None:
            log(f"[dry-run] {p.refs.long} -> {p.local.id} (registry: no such tag) : would push")
        elif p.same_image:
            log(f"[dry-run] {p.refs.long} -> {p.local.id} (registry: {p.remote_long.digest}, same image) : "
                "would skip")
        else:
            problems.append(f"{p.item.variant_id}: {p.refs.long} already points at {p.remote_long.digest}, a "
                            f"different image than {p.local.id}; long tags are immutable")
            log(f"[dry-run] {p.refs.long} -> {p.local.id} (registry: {p.remote_long.digest}, DIFFERENT image) : "
                "would REFUSE")
    log("[dry-run] phase 2: moving short tags (only after every long tag above is verified)")
    results: list[PublishResult] = []
    for p in planned:
        moving = [p.refs.long] if p.local is not None and p.remote_long is None else []
        digest = p.remote_long.digest if p.remote_long else ""
        try:
            remote_short = api.manifest(p.refs.repo, p.item.short_tag)
        except PublishError as exc:
            problems.append(f"{p.item.variant_id}: {exc}")
            log(f"  {p.item.variant_id}: cannot check: {exc}")
            continue
        short_now = remote_short.digest if remote_short else "no such tag"
        target = p.local.id if p.local else p.item.image_id
        if p.error is not None or problems:
            log(f"[dry-run] {p.refs.short} -> {target} (registry: {short_now}) : would not move")
        elif p.same_image and remote_short is not None and remote_short.digest == digest:
            log(f"[dry-run] {p.refs.short} -> {target} (registry: {short_now}) : already there")
        else:
            log(f"[dry-run] {p.refs.short} -> {target} (registry: {short_now}) : would push")
            moving.append(p.refs.short)
        results.append(PublishResult(p.item.variant_id, tuple(moving), digest, p.same_image))
    if problems:
        raise PublishError("dry run: the publish would fail:\n  " + "\n  ".join(problems))
    return results


def _publish(planned: list[PlannedItem], api: RegistryApi, config_dir: Path, secrets: list[str],
             log: Log, long_only: bool, after_long: AfterLong | None = None) -> list[PublishResult]:
    refused = next((p for p in planned if p.error is not None), None)
    if refused is not None:  # phase 0: refuse before pushing anything
        raise fail(refused.error, refused.item, [], [], moving_short_tags=False) from None

    def push(local: LocalImage, ref: str) -> str:
        return copy_image(local.id, ref, config_dir, insecure=api.insecure, log=log, redact=secrets)

    verified: list[tuple[PlannedItem, str, bool, list[str]]] = []
    for p in planned:  # phase 1: push and verify every long (immutable) tag
        try:
            digest, skipped, pushed = _long_tag(p, api, push, log)
        except PublishError as exc:
            raise fail(exc, p.item, [], [v[0].refs.long for v in verified], moving_short_tags=False) from None
        verified.append((p, digest, skipped, pushed))
    for p, digest, _, _ in verified if after_long else ():
        try:
            after_long(p.item, p.refs, digest, api)
        except PublishError as exc:
            raise fail(exc, p.item, [], [v[0].refs.long for v in verified], moving_short_tags=False) from None
    if long_only:
        log(f"all {len(verified)} long tags verified; short tags left to `mopt promote`")
        return [PublishResult(p.item.variant_id, tuple(pushed), digest, skipped)
                for p, digest, skipped, pushed in verified]
    log(f"all {len(verified)} long tags verified; moving the short tags")
    results: list[PublishResult] = []
    for p, digest, skipped, pushed in verified:  # phase 2: only now move the short (moving) tags
        try:
            _short_tag(p, digest, api, log, pushed)
        except PublishError as exc:
            raise fail(exc, p.item, results, [], moving_short_tags=True) from None
        log(f"  verified {p.refs.short} = {digest}")
        results.append(PublishResult(p.item.variant_id, tuple(pushed), digest, skipped))
    return results


Push = Callable[[LocalImage, str], str]  # copy the local image (by id) to ref: the pushed manifest digest


def verify_identity(api: RegistryApi, p: PlannedItem, tag: str, digest: str) -> None:
    """TAG points at DIGEST, every blob it names is present, and it is the tested image: its config digest
    is the image id (or docker itself recorded this manifest as the image's, a RepoDigest)."""
    manifest = api.verify(p.refs.repo, tag, digest)
    if digest in p.local.digests_for(p.refs.name):
        return
    configs = config_digests(api, p.refs.repo, manifest)
    if p.local.id not in configs:
        raise PublishError(f"{p.refs.name}:{tag} = {digest} holds image {', '.join(sorted(configs)) or '(none)'}, "
                           f"not the smoke-tested {p.local.id}")


def _long_tag(p: PlannedItem, api: RegistryApi, push: Push, log: Log) -> tuple[str, bool, list[str]]:
    log(f"publish {p.item.variant_id}: {p.local.id} -> {p.refs.long}")
    pushed: list[str] = []
    remote = api.manifest(p.refs.repo, p.item.long_tag)  # again: another publisher may have raced us
    if remote is None:
        digest, skipped = push(p.local, p.refs.long), False
        pushed.append(p.refs.long)
    elif same_image(api, p.refs.repo, remote, p.local, p.refs.name):
        digest, skipped = remote.digest, True
        try:
            api.check_complete(p.refs.repo, remote)
            log(f"  {p.refs.long} already points at {digest} (this image): not pushed again")
        except PublishError as exc:  # this image, but the registry lost part of it: upload it again
            log(f"  {p.refs.long} holds this image but is incomplete ({exc}); repairing")
            digest, skipped = push(p.local, p.refs.long), False
            pushed.append(p.refs.long)
    else:
        raise immutable_refusal(p.refs.long, remote, p.local)
    verify_identity(api, p, p.item.long_tag, digest)
    log(f"  verified {p.refs.long} = {digest} (image {p.local.id[:19]}, manifest and all blobs present)")
    return digest, skipped, pushed


def _short_tag(p: PlannedItem, digest: str, api: RegistryApi, log: Log, pushed: list[str]) -> None:
    remote = api.manifest(p.refs.repo, p.item.short_tag)
    if remote is not None and remote.digest == digest:
        log(f"  {p.refs.short} already points at {digest}")
    else:
        was = remote.digest if remote else "absent"
        verified = api.manifest(p.refs.repo, digest)
        if verified is None:
            raise PublishError(f"{p.refs.name}@{digest} vanished from the registry before {p.refs.short} moved")
        api.put_manifest(p.refs.repo, p.item.short_tag, verified)
        pushed.append(p.refs.short)
        log(f"  moved {p.refs.short}: {was} -> {digest}")
    verify_identity(api, p, p.item.short_tag, digest)
