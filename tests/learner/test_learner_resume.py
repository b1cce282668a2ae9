"""Crash at every point of a step → resume trains nothing twice and skips nothing."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from safetensors.torch import load_file, save_file

from learner.adapter_store import AdapterExistsError, AdapterStore
from learner.canary import CanaryMonitor
from learner.checkpoint import Checkpoint, resume_plan
from learner.config import LearnerConfig
from learner.service import Learner
from tests.learner.learner_sources import ListSource, synthetic_scored

RECORDS = [synthetic_scored(i) for i in range(12)]
ALL_IDS = {r["trajectory"]["event_id"] for r in RECORDS}


class Crash(RuntimeError):
    pass


def config() -> LearnerConfig:
    return LearnerConfig(
        batch_size=4,
        min_batch=1,
        batch_timeout_s=60,
        micro_batch_size=4,
        lr=1e-3,
        kl_coef=0.05,
        max_staleness=100,
        progress_interval_s=60,
    )


def learner(
    state: Path,
    model_dir: Path,
    announced: list[Path],
    crash_at: str | None = None,
    crash_on: int = 1,
) -> Learner:
    seen = {"n": 0}

    def hook(stage: str) -> None:
        if stage == crash_at:
            seen["n"] += 1
            if seen["n"] == crash_on:
                raise Crash(stage)

    return Learner(
        config(),
        state,
        lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
        model_dir=model_dir,
        on_candidate=announced.append,
        fault_hook=hook,
    )


def lineage_ids(store: AdapterStore) -> list[str]:
    """Event ids trained along the latest version's lineage; checks offsets chain up."""
    chain = store.lineage(store.latest() or 0)
    assert chain[-1] == 1 and chain == list(range(len(chain), 0, -1))
    ids: list[str] = []
    for version in chain:
        meta = store.read_meta(version)
        parent = meta["parent_version"]
        if parent:
            assert meta["start_offsets"] == store.read_meta(parent)["consumed_offsets"]
        ids.extend(meta["data_stats"]["event_ids"])
    return ids


def weights(store: AdapterStore) -> dict[str, torch.Tensor]:
    return load_file(str(store.path(store.latest() or 0) / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AdapterStore:
    state = tmp_path_factory.mktemp("reference")
    announced: list[Path] = []
    summary = learner(state, model_dir, announced).run(max_steps=3)
    assert summary.version == 3 and summary.consumed == 12
    store = AdapterStore(state)
    assert store.versions() == [1, 2, 3] and [p.name for p in announced] == [
        "policy-v1",
        "policy-v2",
        "policy-v3",
    ]
    return store


def test_uninterrupted_run_writes_lineage(reference: AdapterStore) -> None:
    ids = lineage_ids(reference)
    assert sorted(ids) == sorted(ALL_IDS) and len(ids) == len(set(ids))
    meta = reference.read_meta(3)
    assert meta["consumed_offsets"] == {"mem.trajectories": {"0": 12}}
    assert meta["weights_sha256"] and meta["config_hash"] == config().config_hash()
    assert meta["step_metrics"]["tokens"] > 0 and meta["data_stats"]["trajectories"] == 4
    with pytest.raises(AdapterExistsError):
        reference.publish(3, reference.path(3), {})


@pytest.mark.parametrize("stage", ["after_step", "after_checkpoint", "after_publish"])
def test_crash_then_resume_matches_uninterrupted_run(
    stage: str, model_dir: Path, tmp_path: Path, reference: AdapterStore
) -> None:
    announced: list[Path] = []
    with pytest.raises(Crash):
        learner(tmp_path, model_dir, announced, crash_at=stage, crash_on=2).run(max_steps=3)
    resumed = learner(tmp_path, model_dir, announced)
    summary = resumed.run(max_steps=3 - resumed.version)
    store = AdapterStore(tmp_path)
    assert summary.version == 3 and store.versions() == [1, 2, 3]
    ids = lineage_ids(store)
    assert sorted(ids) == sorted(ALL_IDS) and len(ids) == len(set(ids))
    # every version announced exactly once, even the one a crash interrupted
    assert sorted(p.name for p in announced) == ["policy-v1", "policy-v2", "policy-v3"]
    got, want = weights(store), weights(reference)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)


def test_lost_checkpoint_rolls_forward_by_lineage(model_dir: Path, tmp_path: Path) -> None:
    announced: list[Path] = []
    first = learner(tmp_path, model_dir, announced)
    first.run(max_steps=1)
    saved = tmp_path / "checkpoint-v1.pt"
    shutil.copy(first.checkpoints.path, saved)
    learner(tmp_path, model_dir, announced).run(max_steps=1)
    # the adapter v2 exists but the checkpoint goes back to v1 (e.g. restored from backup)
    shutil.copy(saved, tmp_path / "learner" / "checkpoint.pt")
    resumed = learner(tmp_path, model_dir, announced)
    assert resumed.version == 2
    assert resumed.offsets == {"mem.trajectories": {0: 8}}
    # The checkpoint's Adam moments were v1's: they are not applied to v2's weights.
    assert resumed.trainer.optimizer.state_dict()["state"] == {}
    assert resumed.step_count == 2  # v2's own step count, not the v1 checkpoint's
    assert resumed.checkpoints.load().optimizer_version == 2  # type: ignore[union-attr]
    # A stop before the next version: the reset it is to record survives the restart.
    resumed = learner(tmp_path, model_dir, announced)
    assert resumed.optimizer_reset is not None
    resumed.run(max_steps=1)
    assert resumed.checkpoints.load().pending_optimizer_reset is None  # type: ignore[union-attr]
    store = AdapterStore(tmp_path)
    assert store.versions() == [1, 2, 3]
    ids = lineage_ids(store)
    assert sorted(ids) == sorted(ALL_IDS) and len(ids) == len(set(ids))
    meta = json.loads((store.path(3) / "olp_meta.json").read_text())
    assert meta["parent_version"] == 2 and meta["step"] == 3
    assert meta["optimizer_reset"]["at_version"] == 2
    assert "policy-v1" in meta["optimizer_reset"]["reason"]
    # A restart from the checkpoint the roll-forward wrote keeps its (own) optimizer.
    again = learner(tmp_path, model_dir, announced)
    assert again.version == 3 and again.trainer.optimizer.state_dict()["state"]


def test_unrelated_newer_adapter_is_refused(model_dir: Path, tmp_path: Path) -> None:
    announced: list[Path] = []
    learner(tmp_path, model_dir, announced).run(max_steps=1)
    store = AdapterStore(tmp_path)
    meta: dict[str, Any] = store.read_meta(1)
    store.publish(5, store.path(1), {**meta, "parent_version": 4})
    with pytest.raises(RuntimeError, match="do not descend"):
        learner(tmp_path, model_dir, announced)


def test_frozen_learner_consumes_and_trains_nothing(model_dir: Path, tmp_path: Path) -> None:
    frozen = threading.Event()
    frozen.set()
    polls: list[float] = []

    class RecordingSource(ListSource):
        def poll(self, timeout_s: float) -> list[dict[str, Any]]:
            polls.append(time.monotonic())
            return super().poll(timeout_s)

    learner = Learner(
        config(),
        tmp_path,
        lambda offsets, rank, world: RecordingSource({0: RECORDS}, offsets),
        model_dir=model_dir,
        is_frozen=frozen.is_set,
    )
    started = time.monotonic()
    timer = threading.Timer(1.5, frozen.clear)
    timer.start()
    summary = learner.run(max_steps=1, poll_timeout_s=0.1)
    timer.join()
    assert polls and polls[0] >= started + 1.5  # nothing read while frozen
    assert summary.version == 1 and summary.consumed == 4


def test_backlog_beyond_max_batch_trains_the_newest_and_counts_the_rest(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = config().model_copy(update={"batch_size": 4, "min_batch": 4, "max_batch": 4})
    canary = CanaryMonitor()
    canary.begin(["base"], since=0.0)
    learner = Learner(
        cfg,
        tmp_path,
        # One poll hands over all 12 records at once, as after a long step.
        lambda offsets, rank, world: ListSource({0: RECORDS}, offsets, per_poll=12),
        model_dir=model_dir,
        canary=canary,
    )
    with structlog.testing.capture_logs() as logs:
        summary = learner.run(max_steps=1, poll_timeout_s=0.1)
    assert summary.counts["overflow"] == 8
    assert summary.counts["trajectories"] == 4
    # The progress line says it too, not only the batch's one warning.
    progress = [e for e in logs if e["event"] == "learner_progress"]
    assert progress[-1]["dropped"]["overflow"] == 8, progress
    meta = AdapterStore(tmp_path).read_meta(1)
    trained = set(meta["data_stats"]["event_ids"])
    newest = {r["trajectory"]["event_id"] for r in RECORDS[-4:]}
    assert trained <= newest and trained
    assert meta["consumed_offsets"] == {"mem.trajectories": {"0": 12}}  # nothing re-read
    # A running canary saw every reply of the backlog, the overflow's without a reward: the
    # cut keeps the newest, so it dropped the long-running replies first.
    stable = canary.arm("base")
    assert (stable.samples, stable.rewarded) == (2 * len(RECORDS), 2 * 4)


# -- resume_plan on hand-made stores (no model) -----------------------------------------------


def tiny_store(root: Path, parents: dict[int, int]) -> AdapterStore:
    """Versions with the given parents; each version's weights are one tensor of its number."""
    store = AdapterStore(root)
    for version, parent in parents.items():
        files = root / f"files-{version}"
        files.mkdir()
        value = float(version)
        save_file(
            {"lora_A.weight": torch.full((2,), value)}, str(files / "adapter_model.safetensors")
        )
        store.publish(
            version, files, {"parent_version": parent, "consumed_offsets": {"t": {"0": version}}}
        )
    return store


def checkpoint_at(version: int, parent: int | None, value: float | None = None) -> Checkpoint:
    state = {"lora_A.weight": torch.full((2,), float(version if value is None else value))}
    meta = None if parent is None else {"parent_version": parent}
    return Checkpoint(version, version, {"t": {0: version}}, state, {}, {}, {}, meta=meta)


def test_lost_checkpoint_after_pruning_rolls_forward(tmp_path: Path) -> None:
    # retain_dirs pruned v1..v10; the checkpoint is gone: v11's parent v10 is missing.
    store = tiny_store(tmp_path, {v: v - 1 for v in range(11, 21)})
    plan = resume_plan(None, store)
    assert (plan.version, plan.weights_from, plan.offsets) == (20, "adapter", {"t": {0: 20}})
    # An old backup of the checkpoint (v5, its directory pruned too) rolls forward alike.
    assert resume_plan(checkpoint_at(5, 4), store).version == 20


def test_a_newer_version_off_the_lineage_is_refused(tmp_path: Path) -> None:
    # Checkpoint v2; v3 descends from it, v4 is another branch (parent 1).
    store = tiny_store(tmp_path / "a", {1: 0, 2: 1, 3: 2, 4: 1})
    with pytest.raises(RuntimeError, match=r"\[4\] that do not descend"):
        resume_plan(checkpoint_at(2, 1), store)
    # Newest descends (v5 ← v3 ← v2), but v4 is off its lineage: refused, named.
    store = tiny_store(tmp_path / "b", {1: 0, 2: 1, 3: 2, 4: 1, 5: 3})
    with pytest.raises(RuntimeError, match=r"versions \[4\] newer than checkpoint version 2"):
        resume_plan(checkpoint_at(2, 1), store)
    # A gap while the checkpoint's own directory is still there is not pruning: refused.
    store = tiny_store(tmp_path / "c", {1: 0, 5: 4})
    with pytest.raises(RuntimeError, match="do not descend"):
        resume_plan(checkpoint_at(1, 0), store)


def test_roll_forward_does_not_keep_an_older_optimizer(tmp_path: Path) -> None:
    """The checkpoint (v1) is older than the store's newest version (v3): the resumed
    weights are v3's, so v1's Adam moments and scheduler step no longer belong to them."""
    store = tiny_store(tmp_path, {1: 0, 2: 1, 3: 2})
    plan = resume_plan(checkpoint_at(1, 0), store)
    assert (plan.version, plan.weights_from) == (3, "adapter")
    assert plan.keep_optimizer is False
    assert "policy-v3" in plan.optimizer_reason and "policy-v1" in plan.optimizer_reason


def test_roll_forward_refuses_weights_unlike_their_recorded_sha256(tmp_path: Path) -> None:
    """Damaged weights rolled forward to were trained on, then published as the next
    version under a fresh sha256 that every later check accepted."""
    store = tiny_store(tmp_path, {1: 0, 2: 1, 3: 2})
    weights = store.path(3) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(RuntimeError, match=r"policy-v3 has weights unlike its recorded sha256"):
        resume_plan(checkpoint_at(1, 0), store)
    weights.unlink()
    with pytest.raises(RuntimeError, match=r"policy-v3 has no weights file for"):
        resume_plan(checkpoint_at(1, 0), store)


def test_a_rolled_forward_checkpoint_keeps_its_optimizer_only_when_it_matches(
    tmp_path: Path,
) -> None:
    store = tiny_store(tmp_path, {1: 0, 2: 1, 3: 2})
    stored = {"parent_version": 2, "weights_sha256": store.read_meta(3)["weights_sha256"]}
    # Written by a roll-forward before `optimizer_version` existed: v3's metadata beside the
    # optimizer of the older checkpoint it replaced.
    legacy = checkpoint_at(3, 2)
    legacy.meta = dict(stored)
    plan = resume_plan(legacy, store)
    assert (plan.version, plan.weights_from) == (3, "checkpoint")
    assert plan.keep_optimizer is False and "older adapter" in plan.optimizer_reason
    # Written now: the optimizer is recorded as v3's (reset at the roll-forward, or trained).
    current = checkpoint_at(3, 2)
    current.meta, current.optimizer_version = dict(stored), 3
    plan = resume_plan(current, store)
    assert plan.keep_optimizer is True and plan.optimizer_reason == ""
    # A trained checkpoint from before the field: its optimizer is its own.
    assert resume_plan(checkpoint_at(3, 2), store).keep_optimizer is True


def test_continue_verifies_the_stored_copy_of_the_checkpoint_version(tmp_path: Path) -> None:
    store = tiny_store(tmp_path, {1: 0, 2: 1})
    plan = resume_plan(checkpoint_at(2, 1), store)
    assert (plan.version, plan.weights_from, plan.republish) == (2, "checkpoint", False)
    assert resume_plan(checkpoint_at(2, None), store).version == 2  # meta-less checkpoint
    with pytest.raises(RuntimeError, match=r"parent_version 1 != checkpoint's 0"):
        resume_plan(checkpoint_at(2, 0), store)
    with pytest.raises(RuntimeError, match="weights differ from the checkpoint's"):
        resume_plan(checkpoint_at(2, 1, value=7.0), store)
    rolled = checkpoint_at(2, 1)
    rolled.meta = {"parent_version": 1, "weights_sha256": "0" * 64}
    with pytest.raises(RuntimeError, match="sha256 differs"):
        resume_plan(rolled, store)


def test_cleanup_removes_interrupted_builds_but_not_a_running_one(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    for leftover in (".build-abc/files", ".tmp-policy-v3-123"):
        (store.root / leftover).mkdir(parents=True)
        (store.root / leftover / "adapter_model.safetensors").write_bytes(b"x" * 64)
    with store.building() as running:
        assert store.cleanup_temporary() == 2
        assert running.is_dir()
        assert sorted(p.name for p in store.root.iterdir()) == [running.name]
    assert list(store.root.iterdir()) == []


def test_a_huge_score_neither_crashes_nor_poisons_the_learner(
    model_dir: Path, tmp_path: Path
) -> None:
    records = [synthetic_scored(i, n_choices=1) for i in range(8)]
    for i, record in enumerate(records):
        record["feedback"][0]["value"] = 0.1 * i
    records[5]["feedback"][0]["value"] = 1e300  # accepted by POST /v1/feedback
    records[6]["feedback"][0]["value"] = 1e6
    learner = Learner(
        config(),
        tmp_path,
        lambda offsets, rank, world: ListSource({0: records}, offsets),
        model_dir=model_dir,
    )
    summary = learner.run(max_steps=2)
    assert summary.version == 2
    assert summary.counts["reward_score_clamped"] == 2
    assert max(learner.baseline.values.values()) <= config().rewards.feedback_values.score_max
    assert [key.split(":")[-1] for key in learner.baseline.values] == ["syn"]


def test_lineage_ends_at_metadata_that_loops(tmp_path: Path) -> None:
    """A version naming itself (or a newer one) as its parent made lineage() loop for ever."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_config.json").write_text("{}")
    store = AdapterStore(tmp_path / "state")
    store.publish(1, files, {"parent_version": 0})
    store.publish(2, files, {"parent_version": 1})
    store.publish(3, files, {"parent_version": 2})
    assert store.lineage(3) == [3, 2, 1]
    meta_file = store.path(2) / "olp_meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "parent_version": 2}))
    assert store.lineage(3) == [3, 2]
    meta_file.write_text(json.dumps({**meta, "parent_version": 3}))
    assert store.lineage(3) == [3, 2]


def test_offsets_saved_in_another_stream_are_not_resumed(model_dir: Path, tmp_path: Path) -> None:
    """`olp up`'s embedded broker keeps its data in memory: after a restart of the stack the
    saved offsets lay past the end of the new, empty stream and the learner refused to
    start. Offsets of another stream are dropped (weights and version kept); offsets of the
    same stream, or of a stream nobody named, are resumed as before."""
    given: list[object] = []

    def start(stream_id: str | None) -> Learner:
        def factory(offsets: Any, rank: int, world: int) -> ListSource:
            given.append(offsets)
            return ListSource({0: RECORDS}, offsets)

        return Learner(config(), tmp_path, factory, model_dir=model_dir, stream_id=stream_id)

    first = start("embedded-a").run(max_steps=1)
    assert first.version == 1 and given == [None]
    assert AdapterStore(tmp_path).read_meta(1)["stream_id"] == "embedded-a"

    same = start("embedded-a")  # a learner restarted within the same run
    assert given[-1] == {"mem.trajectories": {0: 4}}
    same.close()
    unnamed = start(None)  # `olp learner` on an external Kafka
    assert given[-1] == {"mem.trajectories": {0: 4}}
    unnamed.close()

    again = start("embedded-b").run(max_steps=1)  # the stack started again: a new stream
    assert given[-1] is None
    assert again.version == 2  # the weights and versions go on
    meta = AdapterStore(tmp_path).read_meta(2)
    assert meta["parent_version"] == 1 and meta["stream_id"] == "embedded-b"
    assert meta["start_offsets"] == {} and meta["consumed_offsets"] == {
        "mem.trajectories": {"0": 4}
    }
    after = start("embedded-b")  # its checkpoint now counts in the new stream
    assert given[-1] == {"mem.trajectories": {0: 4}}
    after.close()


def test_the_progress_line_names_only_what_was_dropped() -> None:
    from learner.progress import Progress

    progress = Progress(interval_s=60)
    assert progress.snapshot()["dropped"] == {}
    progress.counts = Counter({"stale": 3, "trained_samples": 20, "capped": 0, "overflow": 1})
    assert progress.snapshot()["dropped"] == {"overflow": 1, "stale": 3}
    # After a restart, as `consumed`: since this start, not an earlier run's.
    progress.counts_at_start = {"overflow": 1, "stale": 1}
    assert progress.snapshot()["dropped"] == {"stale": 2}


def test_a_serving_version_kept_below_a_pruned_gap_stays_on_the_lineage(tmp_path: Path) -> None:
    """Pruning keeps an older version the proxy still serves: {v5 (serving), v7, v8}, v6
    pruned. Walking parent links stopped at v6, so a lost checkpoint called v5 "not on
    the lineage of policy-v8" (and told the operator to move the serving version aside),
    and a checkpoint restored at v5 "did not descend"."""
    store = tiny_store(tmp_path, {v: v - 1 for v in range(1, 9)})
    assert store.read_meta(8)["ancestor_runs"] == [[7, 1]]
    for version in (1, 2, 3, 4, 6):
        shutil.rmtree(store.path(version))
    assert store.versions() == [5, 7, 8]
    assert resume_plan(None, store).version == 8
    assert resume_plan(checkpoint_at(5, 4), store).version == 8
    assert resume_plan(checkpoint_at(3, 2), store).version == 8  # a pruned checkpoint


def test_ancestor_runs_follow_a_branch_and_stay_short(tmp_path: Path) -> None:
    # v1..v4, then v9 trained from v2 (v3, v4 moved aside; the floor skipped their names).
    store = tiny_store(tmp_path, {1: 0, 2: 1, 3: 2, 4: 3, 9: 2, 10: 9})
    assert store.read_meta(10)["ancestor_runs"] == [[9, 9], [2, 1]]
    assert store.ancestors(10) == {9, 2, 1}
    for version in (3, 4):
        shutil.rmtree(store.path(version))
    assert resume_plan(checkpoint_at(2, 1), store).version == 10
    # The moved-aside branch back in place is not this lineage: refused, named.
    store = tiny_store(tmp_path / "b", {1: 0, 2: 1, 3: 2, 9: 2})
    with pytest.raises(RuntimeError, match=r"\[3\] newer than checkpoint version 2"):
        resume_plan(checkpoint_at(2, 1), store)


def test_a_copy_named_with_a_leading_zero_is_not_a_version(tmp_path: Path) -> None:
    """`policy-v01` (an operator's copy) was read as version 1 beside `policy-v1`:
    `versions()` listed 1 twice, and pruning removed the copy as version 1."""
    store = tiny_store(tmp_path, {1: 0, 3: 1})
    shutil.copytree(store.path(1), store.root / "policy-v01")
    shutil.copytree(store.path(3), store.root / "policy-v٣")  # an Arabic-Indic three
    assert store.versions() == [1, 3]


def test_a_changed_lora_alpha_is_refused_as_a_changed_rank_is(
    model_dir: Path, tmp_path: Path
) -> None:
    """lora_alpha scales every LoRA output: resumed under another value, the weights were
    another policy than the served version they are (4x closer to the base at 32 -> 8),
    which skewed the off-policy ratios of its samples, and the next version shipped it."""
    from learner.trainer import AdapterMismatch

    announced: list[Path] = []

    def resumed(alpha: float) -> Learner:
        settings = config().model_copy(update={"lora_alpha": alpha})
        return Learner(
            settings,
            tmp_path,
            lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
            model_dir=model_dir,
            on_candidate=announced.append,
        )

    alpha = config().lora_alpha
    untrained = resumed(alpha)
    untrained._save_checkpoint(None)  # version 0, as after a batch with nothing to train
    resumed(alpha / 2)  # every lora_B still zero: alpha changes nothing yet
    learner(tmp_path, model_dir, announced).run(max_steps=1)
    with pytest.raises(AdapterMismatch, match=rf"trained with learner\.lora_alpha={alpha:g}"):
        resumed(alpha / 4)
    # Rolled forward from the stored version (the checkpoint moved aside): its
    # adapter_config.json says what it was trained under.
    (tmp_path / "learner" / "checkpoint.pt").rename(tmp_path / "checkpoint.aside")
    with pytest.raises(AdapterMismatch, match="policy-v1 was trained with"):
        resumed(alpha * 2)
    assert resumed(alpha).version == 1


def test_weights_resumed_on_another_base_model_are_said_to_be(
    model_dir: Path, tmp_path: Path
) -> None:
    """Neither the checkpoint nor a version named the base model: a state dir resumed on
    another one (`policy.model` changed, same shape) trained on in silence. Both record
    `base_model` now, and a resume on another model says so, naming both."""
    announced: list[Path] = []
    learner(tmp_path / "state", model_dir, announced).run(max_steps=1)
    meta = AdapterStore(tmp_path / "state").read_meta(1)
    assert str(meta["base_model"]).startswith("sha256:")
    other = tmp_path / "other-model"
    other.mkdir()
    for item in model_dir.iterdir():
        if item.name != "config.json":
            (other / item.name).symlink_to(item)
    settings = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**settings, "olp_test_variant": 2}))

    def warnings_resuming_on(model: Path) -> list[dict[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            learner(tmp_path / "state", model, announced)
        return [e for e in logs if e["event"] == "learner_base_model_changed"]

    assert warnings_resuming_on(model_dir) == []
    [said] = warnings_resuming_on(other)
    assert (said["version"], said["trained_on"]) == (1, meta["base_model"])
    assert said["now"] != meta["base_model"] and said["model_dir"] == str(other)
    # The version's own record when the checkpoint is gone (a roll-forward).
    (tmp_path / "state" / "learner" / "checkpoint.pt").unlink()
    [said] = warnings_resuming_on(other)
    assert said["trained_on"] == meta["base_model"]


def test_a_start_refused_by_its_consumer_hands_no_candidate_to_the_promoter(
    model_dir: Path, tmp_path: Path
) -> None:
    """A crash between a version's publish and its announce leaves it to the next start;
    that start handed it to the promoter (which loaded it into vLLM and began its gate)
    before its consumer refused the saved offsets (exit 3)."""
    announced: list[Path] = []
    with pytest.raises(Crash):
        learner(tmp_path, model_dir, announced, crash_at="after_publish").run(max_steps=1)
    assert announced == []

    def refuses(offsets: Any, rank: int, world: int) -> Any:
        raise RuntimeError("saved offsets lie past the end of the stream")

    with pytest.raises(RuntimeError, match="past the end"):
        Learner(config(), tmp_path, refuses, model_dir=model_dir, on_candidate=announced.append)
    assert announced == []
    # An announce that fails (a full disk) closes the consumer made before it.
    consumers: list[ListSource] = []

    def made(offsets: Any, rank: int, world: int) -> ListSource:
        consumers.append(ListSource({0: RECORDS}, offsets))
        return consumers[-1]

    def full(path: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        Learner(config(), tmp_path, made, model_dir=model_dir, on_candidate=full)
    assert [consumer.closed for consumer in consumers] == [True]
    learner(tmp_path, model_dir, announced)
    assert [path.name for path in announced] == ["policy-v1"]
