"""Which images `mopt prune` removes (builder/prune.py), with the Docker calls stood in for: an image that
the pruned state dir, a --keep-state dir or ANOTHER state dir on this host names is never removed; an image
a container uses, or one made since a build elsewhere took its lock, is held; the rest go (by tag, a
dangling one by id), or are only listed on a dry run. Records are real files in real state dirs; only the
functions that call docker (and the host's list of state dirs and lock probes) are replaced.
tests/integration/test_prune.py runs the same against the real daemon."""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

from builder import prune as prune_mod
from builder import statelock
from builder.errors import ConfigError
from builder.prune import OurImage, PruneResult, prune, referenced_image_ids
from builder.state import ModelRecord, StageRecord, StateDir, VariantRecord
from builder.statelock import LockHolder


def iid(name: str) -> str:
    return "sha256:" + name.encode().hex().ljust(64, "0")


def record(state: Path, tag: str, final: str, stages: list[str] = ()) -> None:
    StateDir(state).write_record("img", tag, VariantRecord(
        id=f"img:{tag}", image_id=final, references=(), engine_dir=state / "engines" / "x", engine_sha256="",
        model=ModelRecord(source="generate:test", digest="", dimension=4, substituted=False),
        stages=tuple(StageRecord(name=f"s{i}", key="", image="", image_id=s, skipped=False, seconds=0.0)
                     for i, s in enumerate(stages)), size_bytes=0))


def state_dir(root: Path, name: str) -> Path:
    path = root / name
    StateDir(path).create()
    return path


class FakeDocker:
    """Stands in for the docker calls prune makes: the images carrying our label, the containers' images,
    the images made after a time, `docker rmi` and `docker builder prune`, and the free disk."""

    def __init__(self, monkeypatch, images: list[OurImage], *, containers=(), recent=(), rmi_fails=None,
                 known=(), busy=None):
        self.images = images
        self.containers = set(containers)
        self.recent = set(recent)
        self.rmi_fails = rmi_fails or {}  # image id -> CompletedProcess of a failed rmi
        self.known = list(known)
        self.busy = busy or {}  # state dir -> LockHolder
        self.calls: list[tuple] = []
        self.free = iter([10.0, 25.5])
        self.probed: list[Path] = []
        monkeypatch.setattr(prune_mod, "our_images", self.our_images)
        monkeypatch.setattr(prune_mod, "container_image_ids", self.container_image_ids)
        monkeypatch.setattr(prune_mod, "created_after", self.created_after)
        monkeypatch.setattr(prune_mod, "run_docker", self.run_docker)
        monkeypatch.setattr(prune_mod, "docker_free_gib", lambda: next(self.free))
        monkeypatch.setattr(prune_mod, "known_state_dirs", lambda: list(self.known))
        monkeypatch.setattr(prune_mod, "holder", self.holder)

    def our_images(self, docker, labels=()):
        self.calls.append(("images", docker, tuple(labels)))
        return list(self.images)

    def container_image_ids(self, docker):
        self.calls.append(("containers", docker))
        return set(self.containers)

    def created_after(self, docker, images, cutoff):
        self.calls.append(("created_after", docker, [i.image_id for i in images], cutoff))
        return {i.image_id for i in images} & self.recent

    def holder(self, root):
        self.probed.append(Path(root))
        return self.busy.get(Path(root))

    def run_docker(self, args, *, docker=None, check=True, timeout=None, error_cls=None, **kwargs):
        assert docker is DOCKER and not kwargs
        self.calls.append(("run", list(args), check, timeout, error_cls))
        if args[0] == "rmi":
            image = next(i for i in self.images if list(args[1:]) in (list(i.tags), [i.image_id]))
            if image.image_id in self.rmi_fails:
                return self.rmi_fails[image.image_id]
        return subprocess.CompletedProcess(list(args), 0, "", "")

    def runs(self, command: str) -> list[list[str]]:
        return [c[1] for c in self.calls if c[0] == "run" and c[1][0] == command]


DOCKER = object()  # the DockerCli prune is given: passed through to every docker call as it is

NAMED_HERE, STAGE_HERE = OurImage(iid("final-here"), ("mopt/a:1",)), OurImage(iid("stage-here"), ())
NAMED_KEPT = OurImage(iid("final-kept"), ("mopt/b:1",))
NAMED_ELSEWHERE = OurImage(iid("stage-elsewhere"), ("mopt-stage/x:k1",))
STALE = OurImage(iid("stale"), ("mopt-stage/x:k0", "mopt/old:alias"))
DANGLING = OurImage(iid("dangling"), ())
IN_A_CONTAINER = OurImage(iid("container"), ("mopt/run:1",))
RECENT = OurImage(iid("recent"), ())


@pytest.fixture
def dirs(tmp_path):
    """The pruned state dir, a --keep-state dir and another checkout's state dir, each with its records."""
    here, kept, other = (state_dir(tmp_path, n) for n in ("here", "kept", "other"))
    record(here, "1", NAMED_HERE.image_id, [STAGE_HERE.image_id, ""])
    record(kept, "1", NAMED_KEPT.image_id)
    record(other, "1", "", [NAMED_ELSEWHERE.image_id])
    return here, kept, other


def ids(images) -> list[str]:
    return sorted(i.image_id for i in images)


def test_only_images_no_state_dir_names_are_removed(monkeypatch, dirs):
    here, kept, other = dirs
    images = [NAMED_HERE, STAGE_HERE, NAMED_KEPT, NAMED_ELSEWHERE, STALE, DANGLING]
    fake = FakeDocker(monkeypatch, images, known=[here, other])
    logs: list[str] = []
    result = prune(DOCKER, here, [kept], log=logs.append)
    assert isinstance(result, PruneResult)
    assert ids(result.removed) == ids([STALE, DANGLING])
    assert list(result.kept) == [NAMED_HERE, STAGE_HERE, NAMED_KEPT, NAMED_ELSEWHERE]
    assert result.held == () and result.failed == ()
    # By tag (every name of the image at once), a dangling one by id.
    assert fake.runs("rmi") == [["rmi", "mopt-stage/x:k0", "mopt/old:alias"], ["rmi", DANGLING.image_id]]
    assert {c[2:] for c in fake.calls if c[0] == "run"} == {(False, 300, None)}  # a failure is per image
    assert "removed mopt-stage/x:k0 mopt/old:alias" in logs and f"removed {DANGLING.image_id[:19]}" in logs
    assert (result.free_before_gib, result.free_after_gib) == (10.0, 25.5)
    assert ("images", DOCKER, ()) in fake.calls and ("containers", DOCKER) in fake.calls


def test_another_state_dirs_images_are_kept_without_being_named(monkeypatch, dirs):
    """Without --keep-state: the host's other state dirs still keep theirs; the pruned dir is not one of them."""
    here, kept, other = dirs
    fake = FakeDocker(monkeypatch, [NAMED_HERE, NAMED_KEPT, NAMED_ELSEWHERE], known=[kept, other, here])
    result = prune(DOCKER, here, log=lambda _: None)
    assert ids(result.removed) == [] and ids(result.kept) == ids([NAMED_HERE, NAMED_KEPT, NAMED_ELSEWHERE])
    assert fake.runs("rmi") == []
    # The pruned dir is locked by prune itself: probing it would hold everything made since prune began.
    assert fake.probed == [kept, other]


def test_without_the_other_state_dirs_their_images_go(monkeypatch, dirs):
    here, _, _ = dirs
    fake = FakeDocker(monkeypatch, [NAMED_HERE, NAMED_KEPT, NAMED_ELSEWHERE], known=[])
    result = prune(DOCKER, here, log=lambda _: None)
    assert ids(result.removed) == ids([NAMED_KEPT, NAMED_ELSEWHERE]) and list(result.kept) == [NAMED_HERE]
    assert fake.runs("rmi") == [["rmi", "mopt/b:1"], ["rmi", "mopt-stage/x:k1"]]


def test_a_relative_or_repeated_keep_state_counts(monkeypatch, dirs):
    here, kept, _ = dirs
    monkeypatch.chdir(kept.parent)
    FakeDocker(monkeypatch, [NAMED_HERE, NAMED_KEPT, STALE])
    result = prune(DOCKER, Path("here"), [Path("kept"), kept, Path("here")], log=lambda _: None)
    assert ids(result.removed) == ids([STALE])


def test_images_in_use_or_made_during_a_build_elsewhere_are_held(monkeypatch, dirs, tmp_path):
    here, kept, other = dirs
    third = state_dir(tmp_path, "third")
    early, late = LockHolder(11, "mopt build", 1000.0), LockHolder(12, "mopt build", 2000.0)
    images = [NAMED_HERE, NAMED_ELSEWHERE, STALE, IN_A_CONTAINER, RECENT, DANGLING]
    # The earliest lock is the later path ("third" > "other"): the lock's start decides, not the name.
    fake = FakeDocker(monkeypatch, images, containers=[IN_A_CONTAINER.image_id, iid("not ours")],
                      recent=[RECENT.image_id, NAMED_ELSEWHERE.image_id], known=[here, other, third],
                      busy={third: early, other: late})
    result = prune(DOCKER, here, log=lambda _: None)
    assert ids(result.removed) == ids([STALE, DANGLING])
    assert list(result.kept) == [NAMED_HERE, NAMED_ELSEWHERE]
    assert list(result.held) == [(IN_A_CONTAINER, "a container uses it"),
                                 (RECENT, f"made since {third} was locked by {early.describe()}")]
    # Asked only about the images no record keeps, since the earliest lock.
    [asked] = [c for c in fake.calls if c[0] == "created_after"]
    assert asked == ("created_after", DOCKER, [i.image_id for i in (STALE, IN_A_CONTAINER, RECENT, DANGLING)], 1000.0)


def test_a_container_reason_wins_over_a_busy_lock(monkeypatch, dirs):
    here, _, other = dirs
    both = OurImage(iid("both"), ("mopt/both:1",))
    FakeDocker(monkeypatch, [both], containers=[both.image_id], recent=[both.image_id], known=[other],
               busy={other: LockHolder(1, "mopt build", 5.0)})
    result = prune(DOCKER, here, log=lambda _: None)
    assert result.held == ((both, "a container uses it"),) and result.removed == ()


def test_no_lock_elsewhere_asks_nothing_about_creation_times(monkeypatch, dirs):
    here, _, other = dirs
    fake = FakeDocker(monkeypatch, [STALE, RECENT], recent=[RECENT.image_id], known=[other])
    result = prune(DOCKER, here, log=lambda _: None)
    assert ids(result.removed) == ids([STALE, RECENT])
    assert not [c for c in fake.calls if c[0] == "created_after"]


def test_a_dry_run_lists_what_would_go_and_removes_nothing(monkeypatch, dirs):
    here, kept, _ = dirs
    fake = FakeDocker(monkeypatch, [NAMED_HERE, STALE, DANGLING, IN_A_CONTAINER],
                      containers=[IN_A_CONTAINER.image_id])
    logs: list[str] = []
    result = prune(DOCKER, here, [kept], build_cache_gib=2.5, dry_run=True, log=logs.append)
    assert ids(result.removed) == ids([STALE, DANGLING]) and list(result.kept) == [NAMED_HERE]
    assert list(result.held) == [(IN_A_CONTAINER, "a container uses it")]
    assert [c for c in fake.calls if c[0] == "run"] == []
    assert "would remove mopt-stage/x:k0 mopt/old:alias" in logs
    assert f"would remove {DANGLING.image_id[:19]}" in logs
    assert "would trim BuildKit's cache to 2.5 GiB" in logs


def test_a_failed_removal_is_reported_with_dockers_reason(monkeypatch, dirs):
    here, _, _ = dirs
    failed = {STALE.image_id: subprocess.CompletedProcess([], 1, "", "warning\nError: conflict: in use\n"),
              DANGLING.image_id: subprocess.CompletedProcess([], 1, "out says why\n", ""),
              RECENT.image_id: subprocess.CompletedProcess([], 1, "", "")}
    extra = OurImage(iid("fine"), ("mopt/fine:1",))
    FakeDocker(monkeypatch, [STALE, DANGLING, RECENT, extra], rmi_fails=failed)
    result = prune(DOCKER, here, log=lambda _: None)
    assert list(result.removed) == [extra]
    assert list(result.failed) == [(STALE, "Error: conflict: in use"), (DANGLING, "out says why"),
                                   (RECENT, "docker rmi failed")]


@pytest.mark.parametrize("gib, keep", [(2.5, str(int(2.5 * 2**30))), (0, "0"), (0.001, "1073741")])
def test_the_build_cache_is_trimmed_to_the_given_size(monkeypatch, dirs, gib, keep):
    here, _, _ = dirs
    fake = FakeDocker(monkeypatch, [])
    logs: list[str] = []
    prune(DOCKER, here, build_cache_gib=gib, log=logs.append)
    assert [c[1:] for c in fake.calls if c[0] == "run"] == [
        (["builder", "prune", "--force", "--keep-storage", keep], True, 900, prune_mod.EnvironmentProblem)]
    assert logs[-1] == f"trimmed BuildKit's cache to {gib:g} GiB"


def test_no_size_leaves_the_build_cache(monkeypatch, dirs):
    here, _, _ = dirs
    fake = FakeDocker(monkeypatch, [STALE])
    prune(DOCKER, here, labels=["io.mopt.test=1"], log=lambda _: None)
    assert fake.runs("builder") == [] and ("images", DOCKER, ("io.mopt.test=1",)) in fake.calls


def test_prune_waits_for_a_build_of_its_state_dir_and_says_so(monkeypatch, dirs):
    here, _, _ = dirs
    FakeDocker(monkeypatch, [STALE])
    monkeypatch.setenv(statelock.ENV_LOCK_WAIT, "30")
    held, release = threading.Event(), threading.Event()

    def build():
        with statelock.state_lock(here, "mopt build", log=lambda _: None):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=build)
    thread.start()
    held.wait(10)
    logs: list[str] = []
    threading.Timer(0.2, release.set).start()
    result = prune(DOCKER, here, log=logs.append)
    thread.join(10)
    assert logs[0].startswith(f"waiting for state dir {here}: in use by pid ")  # through prune's log
    assert "(mopt build, since" in logs[0] and ids(result.removed) == ids([STALE])


def test_prune_holds_the_state_dirs_lock_while_it_selects(monkeypatch, dirs):
    here, _, _ = dirs
    fake = FakeDocker(monkeypatch, [STALE])
    seen = []
    real_images = fake.our_images

    def images(docker, labels=()):
        seen.append(statelock.holder(here))  # the real probe: someone holds the lock now
        return real_images(docker, labels)

    monkeypatch.setattr(prune_mod, "our_images", images)
    prune(DOCKER, here, log=lambda _: None)
    assert seen[0] is not None and seen[0].command == "mopt prune"
    assert statelock.holder(here) is None  # released afterwards


# --------------------------------------------------------------------------- which ids the records name
def test_referenced_ids_are_every_final_and_stage_image_named(dirs):
    here, kept, other = dirs
    record(here, "2", iid("second"), [iid("s1"), iid("s2")])
    assert referenced_image_ids([here]) == {NAMED_HERE.image_id, STAGE_HERE.image_id, iid("second"), iid("s1"),
                                            iid("s2")}
    assert referenced_image_ids([kept], [other]) == {NAMED_KEPT.image_id, NAMED_ELSEWHERE.image_id}
    assert referenced_image_ids([], [other, kept]) == {NAMED_KEPT.image_id, NAMED_ELSEWHERE.image_id}
    assert "" not in referenced_image_ids([here, other])


def test_an_unreadable_record_in_a_kept_state_dir_stops_prune(monkeypatch, dirs):
    here, kept, _ = dirs
    (kept / "variants" / "img" / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: unreadable variant record"):
        referenced_image_ids([here, kept])
    fake = FakeDocker(monkeypatch, [STALE])
    with pytest.raises(ConfigError, match="unreadable variant record"):
        prune(DOCKER, here, [kept], log=lambda _: None)
    assert fake.runs("rmi") == []


def test_an_unreadable_record_elsewhere_is_noted_and_its_neighbours_still_count(dirs):
    here, _, other = dirs
    record(other, "2", iid("other-2"))
    bad = other / "variants" / "img" / "0-bad.json"
    bad.write_text("{not json")
    # Read in name order after the bad one: a smoke record is skipped, and so is another unreadable record;
    # the readable ones after them still count.
    (other / "variants" / "img" / "0.smoke.json").write_text('{"image_id": "sha256:x", "passed": true}')
    (other / "variants" / "img" / "00.json").write_text('{"id": "x"}')
    logs: list[str] = []
    got = referenced_image_ids([here], [other], log=logs.append)
    assert got == {NAMED_HERE.image_id, STAGE_HERE.image_id, NAMED_ELSEWHERE.image_id, iid("other-2")}
    [note] = logs
    assert note.startswith(f"note: {bad}: unreadable variant record") and note.endswith(
        f"(state dir {other}: its other records still count)")


def test_an_unreadable_record_elsewhere_is_noted_through_prunes_log(monkeypatch, dirs):
    here, _, other = dirs
    (other / "variants" / "img" / "0-bad.json").write_text("{not json")
    FakeDocker(monkeypatch, [NAMED_ELSEWHERE, STALE], known=[other])
    logs: list[str] = []
    result = prune(DOCKER, here, log=logs.append)
    assert list(result.kept) == [NAMED_ELSEWHERE] and list(result.removed) == [STALE]
    assert logs[0].startswith("note: ") and logs[0].endswith(f"(state dir {other}: its other records still count)")


def test_a_record_that_vanishes_while_read_elsewhere_is_skipped(monkeypatch, dirs):
    """_readable_ids reads each record again: one gone meanwhile (read_record gives None) names nothing."""
    here, _, other = dirs
    (other / "variants" / "img" / "0-bad.json").write_text("{not json")  # read first: records() stops there
    real = StateDir.read_record
    monkeypatch.setattr(StateDir, "read_record", lambda self, image, tag: None if tag == "1" else real(self, image,
                                                                                                       tag))
    assert referenced_image_ids([], [other], log=lambda _: None) == set()
