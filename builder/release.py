"""mopt release: plan -> build -> test -> publish for every selected variant, keep-going by
default, with live progress and a report (JSON + Markdown) under <state>/reports/.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .attest.provenance import AttestInputs
from .build import Builder, BuildOptions
from .errors import MoptError, PublishError, SmokeTestError
from .hashing import dump_json, sha256_text
from .imagesize import GB, check_budget, image_layers
from .matrix import load_matrix
from .models import SUBSTITUTE_SUFFIX, image_tags
from .plan import Variant, make_plan
from .report import ReleaseReport, VariantReport
from .state import SmokeRecord, StateDir, VariantRecord
from .statelock import state_lock

console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def _say(message: str) -> None:
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {escape(message)}")


def _smoke(state: StateDir, matrix, variant: Variant, record: VariantRecord, row: VariantReport) -> None:
    from .smoke import SmokeSpec, smoke_test

    recipe = matrix.image(variant.image).recipe
    engine_dir = record.engine_dir
    reference_file = engine_dir / "reference.json"  # chat engines have no embedding reference
    spec = SmokeSpec(image=record.image_id, port=recipe.port, inputs=recipe.smoke_inputs,
                     dimension=record.model.dimension, min_cosine=recipe.min_cosine,
                     normalize=recipe.normalize,
                     reference=json.loads(reference_file.read_text()) if reference_file.is_file() else {},
                     engine_json=json.loads((engine_dir / "engine.json").read_text()),
                     start_timeout_s=recipe.start_timeout_s, gpu=variant.device == "cuda", task=recipe.task)
    # A pass is reused only for the same image and the same checks (dimension, inputs, threshold).
    smoke_key = sha256_text(json.dumps(asdict(spec), sort_keys=True, default=str))
    previous = state.read_smoke(variant.image, variant.tag)
    if previous is not None and previous.key == smoke_key and previous.passed:
        _say(f"{variant.id}: smoke test already passed for {record.image_id[:19]} with these checks; not repeated")
        row.tested, row.smoke = True, previous.checks
        return
    _say(f"{variant.id}: smoke test in a container")
    result = smoke_test(spec, log=_say)
    state.write_smoke(variant.image, variant.tag, SmokeRecord(
        image_id=record.image_id, key=smoke_key, passed=result.passed, checks=result.checks,
        min_cosine=result.min_cosine, start_seconds=result.start_seconds))
    row.smoke = result.checks | {"min_cosine": result.min_cosine, "start_seconds": result.start_seconds}
    if not result.passed:
        raise SmokeTestError(f"{variant.id}: smoke test failed: " + "; ".join(result.failures))
    row.tested = True
    _say(f"{variant.id}: smoke test passed (cosine {result.min_cosine:.5f}, healthy after {result.start_seconds}s)")


def _bench(matrix, variant: Variant, record: VariantRecord, row: VariantReport) -> None:
    """A short bench of the tested image (builder/bench/run.py's release_bench) into the report; a bench that
    fails is a note, not a failed variant: the image passed its smoke test."""
    from .bench.progress import Progress
    from .bench.run import release_bench
    from .bench.target import Target

    if matrix.image(variant.image).recipe.task != "embedding":
        row.notes.append("bench: not run (mopt bench measures embeddings servers)")
        return
    _say(f"{variant.id}: bench")
    row.bench = release_bench(Target(variant.id, record.image_id, "image"), Progress(console))
    if "error" in row.bench:
        row.notes.append(f"bench: {row.bench['error']}")
        return
    _say(f"{variant.id}: {row.bench_text}")


def _publish_item(state: StateDir, variant: Variant, record: VariantRecord, allow_substitute: bool):
    """The PublishItem for a variant whose smoke test passed for exactly this image. A substituted model
    is published only when asked for, and then only under its -substitute tags."""
    from .registry.phases import PublishItem

    if not state.smoke_passed(variant.image, variant.tag, record):
        raise PublishError(f"{variant.id}: image {record.image_id[:19]} has not passed its smoke test; "
                           "not publishing")
    refuse_substitute(variant, record, allow_substitute, "publishing")
    short_tag, long_tag = image_tags(variant.tag, variant.long_tag, record.model.substituted)
    return PublishItem(variant_id=variant.id, image_id=record.image_id, repository=variant.repository,
                       long_tag=long_tag, short_tag=short_tag)


def refuse_substitute(variant: Variant, record: VariantRecord, allow_substitute: bool, doing: str) -> None:
    if record.model.substituted and not allow_substitute:
        raise PublishError(f"{variant.id}: image {record.image_id[:19]} holds {record.model.source}, a substitute "
                           f"for {record.model.declared or 'the recipe model'}; not {doing} it (pass "
                           f"--allow-substitute to ship it as {variant.tag}{SUBSTITUTE_SUFFIX})")


def record_file(record_dir: Path, variant_id: str) -> Path:
    """Where a variant's long-tag record goes (one file per variant: runners' uploads never collide)."""
    return record_dir / (variant_id.replace(":", "--").replace("/", "_") + ".json")


def _signer(key_paths: tuple[Path, ...], inputs: dict, log):
    """publish's after_long: sign and attach each published image's SBOM and provenance (attest/)."""
    from .attest import cosign, dsse, referrers
    from .attest.provenance import CYCLONEDX, SLSA_PROVENANCE
    from .attest.signing import attest
    from .dockerclient import find_docker

    keys = [dsse.load_private_key(path) for path in key_paths]
    docker = find_docker()

    def after_long(item, refs, digest, api) -> None:
        # Before any short tag moves: the image signed for both its tags (cosign's format) by every key, then
        # its SBOM and provenance attached (signing again replaces a key's own signatures; another key's stay).
        for key in keys:
            cosign.sign(api, refs.repo, digest, [refs.long, refs.short], key)
        log(f"  signed {refs.long} and {refs.short} = {digest} (sigstore/cosign signature, {len(keys)} key(s))")
        index = api.manifest(refs.repo, referrers.referrers_tag(digest))
        attached = {e.get("annotations", {}).get(referrers.PREDICATE_ANNOTATION)
                    for e in (index.body.get("manifests", []) if index else [])}
        if {CYCLONEDX, SLSA_PROVENANCE} <= attached:
            log(f"  {refs.long} = {digest} already has its SBOM and provenance attached")
            return
        attest(api, refs.repo, refs.name, digest, inputs[item.variant_id], keys, docker, log)
    return after_long


def _publish_all(pending: list, registry: str, dry_run: bool, record_dir: Path | None = None,
                 sign_keys: tuple[Path, ...] = (), attest_inputs: dict | None = None) -> PublishError | None:
    """Publish every variant that reached the publish step as ONE release: all long tags pushed and
    verified before any short tag moves. With RECORD_DIR, only the long tags (a runner's share of a
    distributed release), each recorded there for `mopt promote`. Returns the error (rows already
    marked), or None."""
    from .registry.phases import LongTagRecord, publish
    from .registry.reference import Registry

    if not pending:
        return None
    started = time.monotonic()
    reg = Registry.parse(registry)
    _say(f"publish {len(pending)} variants: long tags first, "
         + ("short tags left to mopt promote" if record_dir else "short tags once all are verified"))
    try:
        after_long = _signer(sign_keys, attest_inputs or {}, _say) if sign_keys and not dry_run else None
        results = publish([item for item, _ in pending], reg, dry_run=dry_run, log=_say,
                          long_only=record_dir is not None, after_long=after_long)
    except PublishError as exc:
        failed = exc.failed
        moved = {r.variant_id: r for r in exc.published}
        for item, row in pending:
            if item.variant_id in moved:
                row.published, row.digest = True, moved[item.variant_id].digest
                row.references = list(moved[item.variant_id].references)
            elif failed is None or item.variant_id == failed:
                row.failed_step, row.reason = "publish", exc.message
            else:
                row.failed_step = "publish"
                row.reason = f"not published: the release's publish stopped at {failed}"
        _say(f"publish FAILED: {exc.message}")
        return exc
    seconds = round(time.monotonic() - started, 1)
    for (item, row), result in zip(pending, results, strict=True):
        row.durations["publish"] = seconds
        if not dry_run:
            row.published, row.digest, row.references = True, result.digest, list(result.references)
        if record_dir is not None and not dry_run:
            record = LongTagRecord(item.variant_id, item.image_id, item.repository, item.long_tag, item.short_tag,
                                   str(reg), result.digest)
            path = record_file(record_dir, item.variant_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump_json(record.to_json()), encoding="utf-8")
            _say(f"{item.variant_id}: long tag recorded in {path}")
    return None


def _size_check(matrix, variant: Variant, record: VariantRecord, row: VariantReport) -> None:
    budget = next(f for f in matrix.image(variant.image).flavours if f.name == variant.flavour).size_budget_gb
    layers = image_layers(record.image_id)
    row.layers = [asdict(layer) for layer in layers]
    row.size_budget_bytes = int(budget * GB) if budget else 0
    check_budget(variant.id, record.size_bytes, budget, layers)


def run_release(matrix_path: str, select: tuple[str, ...], options: BuildOptions, *, steps: tuple[str, ...],
                registry: str | None = None, dry_run: bool = False, fail_fast: bool = False,
                allow_substitute: bool = False, record_dir: Path | None = None,
                sign_keys: tuple[Path, ...] = (), bench: bool = False) -> ReleaseReport:
    """Every step in one process holding the state dir's lock (statelock.py): a second build, test or
    publish on the same state dir waits for it. RECORD_DIR: publish long tags only, recorded there."""
    matrix = load_matrix(Path(matrix_path))  # a broken matrix is reported at once, not after the lock
    with state_lock(options.state.root, f"mopt {' + '.join(steps)}", log=_say):
        return _run_release(matrix, select, options, steps=steps, registry=registry, dry_run=dry_run,
                            fail_fast=fail_fast, allow_substitute=allow_substitute, record_dir=record_dir,
                            sign_keys=sign_keys, bench=bench)


def _run_release(matrix, select: tuple[str, ...], options: BuildOptions, *, steps: tuple[str, ...],
                 registry: str | None, dry_run: bool, fail_fast: bool, allow_substitute: bool,
                 record_dir: Path | None, sign_keys: tuple[Path, ...], bench: bool = False) -> ReleaseReport:
    full = make_plan(matrix)
    plan = make_plan(matrix, select) if select else full
    report = ReleaseReport(started=time.time(), steps=list(steps), registry=registry or "",
                           rejected=[r.to_json() for r in plan.rejected])
    state = options.state
    builder = None
    first_error: MoptError | None = None
    pending: list = []  # (PublishItem, row): published together once every variant is through
    attest_inputs: dict = {}  # variant id -> what its signed provenance states
    _say(f"{len(plan.variants)} variants to {' -> '.join(steps)}")
    for variant in plan.variants:
        row = VariantReport(id=variant.id, image=variant.image, flavour=variant.flavour, tag=variant.tag,
                            long_tag=variant.long_tag, cuda=variant.resolved.cuda or "",
                            sm=variant.resolved.sm or "")
        report.variants.append(row)
        step = ""
        try:
            record = state.read_record(variant.image, variant.tag)
            for step in steps:
                started = time.monotonic()
                if step == "build":
                    builder = builder or Builder(matrix, full.variants, options, log=_say)
                    _say(f"{variant.id}: build")
                    result = builder.build(variant)
                    record = state.read_record(variant.image, variant.tag)
                    row.build_work = result.built_anything
                    row.notes += list(result.notes)
                    _say(f"{variant.id}: built {result.image_id[:19]} "
                         + ("" if result.built_anything else "(nothing to build: every stage up to date)"))
                elif record is None:
                    raise MoptError(f"{variant.id}: not built yet (run mopt build first)")
                row.built, row.image_id, row.size_bytes = True, record.image_id, record.size_bytes
                if step == "build":  # where the image was just made: one over its budget goes no further
                    _size_check(matrix, variant, record, row)
                if record.model.substituted:
                    row.tag, row.long_tag = image_tags(variant.tag, variant.long_tag, True)
                    row.substitute = f"{record.model.source} for {record.model.declared}: {record.model.why}"
                if step == "test":
                    _smoke(state, matrix, variant, record, row)
                    if bench:
                        _bench(matrix, variant, record, row)
                elif step == "publish":
                    pending.append((_publish_item(state, variant, record, allow_substitute), row))
                    attest_inputs[variant.id] = AttestInputs(variant, record, state, options.lock_file)
                    continue
                row.durations[step] = round(time.monotonic() - started, 1)
        except MoptError as exc:
            row.failed_step, row.reason = step, exc.message
            first_error = first_error or exc
            _say(f"{variant.id}: FAILED at {step}: {exc.message}")
            if fail_fast:
                break
    if pending and not (fail_fast and first_error is not None):
        publish_error = _publish_all(pending, registry or "", dry_run, record_dir, sign_keys, attest_inputs)
        first_error = first_error or publish_error
    report.finished = time.time()
    json_path, md_path = report.write(state.reports)
    console.print(report.markdown(), markup=False)
    summary = report.summary()
    if "build" in steps and summary["build_work"] == 0 and not summary["failed"]:
        _say("nothing was rebuilt: every stage and engine was already up to date")
    _say(f"report: {json_path} and {md_path}")
    if first_error is not None:
        failed = summary["failed"]
        # The first failure's class decides the exit code (4 build, 5 smoke test, 6 publish, ...).
        raise type(first_error)(f"{failed} of {len(report.variants)} variants failed; see {md_path}")
    return report


def _signature_check(key_paths: tuple[Path, ...]):
    """promote's check of each long tag: an image signature, SBOM and provenance by one of the keys."""
    from .attest import dsse
    from .attest.signing import verify
    from .errors import VerificationFailed

    keys = [dsse.load_public_key(path) for path in key_paths]

    def check(api, refs, long_tag: str) -> None:
        failures = []
        for key in keys:
            try:
                verify(api, refs.repo, refs.name, long_tag, key)
                return
            except VerificationFailed as exc:
                failures.append(exc.message)
        raise PublishError(f"{refs.long} is not signed by any of the {len(keys)} verify key(s): "
                           + "; ".join(failures))
    return check


def run_promote(matrix_path: str, select: tuple[str, ...], registry: str, record_dir: Path, state: StateDir,
                docker_config: str | None = None, verify_keys: tuple[Path, ...] = ()) -> list:
    """The fan-in job of a distributed release: every planned variant's long-tag record must be in
    RECORD_DIR and verify in the registry before any short tag moves (registry.phases.promote).
    Writes reports/promote.md and .json."""
    from .registry.phases import LongTagRecord, promote
    from .registry.reference import Registry
    from .yamlio import parse_json_bounded

    matrix = load_matrix(Path(matrix_path))
    plan = make_plan(matrix, select) if select else make_plan(matrix)
    expected = [v.id for v in plan.variants]
    if not record_dir.is_dir():
        raise PublishError(f"{record_dir}: no such directory of long-tag records; no short tag was moved")
    records = []
    for path in sorted(record_dir.rglob("*.json")):
        record = LongTagRecord.from_json(parse_json_bounded(path.read_text(encoding="utf-8"), str(path)), str(path))
        if record.variant_id in expected:
            records.append(record)
        else:
            _say(f"note: {path} is for {record.variant_id}, not a variant of this release; ignored")
    ids = [r.variant_id for r in records]
    twice = sorted({v for v in ids if ids.count(v) > 1})
    if twice:
        raise PublishError(f"two long-tag records for {', '.join(twice)}; no short tag was moved")
    _say(f"promote {len(expected)} variants: {len(records)} long-tag records found")
    check = _signature_check(verify_keys) if verify_keys else None
    results = promote(records, expected, Registry.parse(registry), docker_config=docker_config, log=_say,
                      check_signed=check)
    by_id = {r.variant_id: r for r in records}
    rows = [{"variant": r.variant_id, "long_tag": by_id[r.variant_id].long_tag,
             "short_tag": by_id[r.variant_id].short_tag, "digest": r.digest,
             "short_tag_moved": bool(r.references)} for r in results]
    state.reports.mkdir(parents=True, exist_ok=True)
    (state.reports / "promote.json").write_text(dump_json({"registry": registry, "variants": rows}))
    lines = [f"## Release promoted to {registry}", "", "| variant | long tag | short tag | digest | short tag |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['variant']} | {r['long_tag']} | {r['short_tag']} | `{r['digest'][:19]}` | "
              f"{'moved' if r['short_tag_moved'] else 'already there'} |" for r in rows]
    (state.reports / "promote.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines), markup=False)
    return results
