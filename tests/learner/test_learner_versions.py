"""Version names are never reused: a learner on a wiped state dir numbers its candidates
above every `policy-v<N>` vLLM still serves (else vLLM answers "already loaded" and keeps
the old weights under the new name)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy import learner_runner
from deploy.config import OlpConfig
from deploy.learner_runner import proxy_versions, served_versions
from learner.adapter_store import AdapterStore
from learner.checkpoint import CheckpointStore, raise_version_floor, resume_plan
from learner.config import LearnerConfig
from learner.objective import Sample, drop_stale
from learner.promotion import ReplicaSet, named_versions
from learner.service import Learner
from tests.conftest import VllmServer
from tests.learner.learner_sources import ListSource, synthetic_scored
from tests.learner.test_learner_runner import fakes

RECORDS = [synthetic_scored(i) for i in range(8)]  # all served by the base model


def config() -> LearnerConfig:
    return LearnerConfig(
        batch_size=4,
        min_batch=1,
        batch_timeout_s=60,
        micro_batch_size=4,
        lr=1e-3,
        max_staleness=1,  # a base sample N versions "old" by number alone would be dropped
        progress_interval_s=60,
    )


def learner(state: Path, model_dir: Path, announced: list[Path], served: list[str]) -> Learner:
    return Learner(
        config(),
        state,
        lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
        model_dir=model_dir,
        on_candidate=announced.append,
        served_versions=lambda: served,
    )


def sample(version: int) -> Sample:
    return Sample(
        key=f"t{version}:0",
        event_id=f"e{version}",
        prompt_ids=[1],
        completion_ids=[2],
        sampling_logprobs=[-1.0],
        reward=1.0,
        group=None,
        task="t",
        tenant="A",
        user=None,
        policy_version=version,
    )


def test_floor_counts_only_served_versions_newer_than_our_own() -> None:
    served = ["base", "olp-zero-base", "policy-v1", "policy-v7", "policy-vx", "policy-v7-old"]
    assert raise_version_floor(0, 0, served) == 7  # wiped state dir: v1..v7 are not ours
    assert raise_version_floor(0, 8, ["policy-v5", "policy-v8"]) == 0  # ours: no clash
    assert raise_version_floor(7, 8, []) == 7  # a persisted floor never goes down
    assert raise_version_floor(2, 3, ["policy-v3", "policy-v6"]) == 6  # older backup


def test_drop_stale_counts_versions_below_the_floor_as_the_floor() -> None:
    samples = [sample(0), sample(5), sample(7), sample(8), sample(9)]
    kept, dropped = drop_stale(samples, 9, 1, floor=7)
    assert [s.policy_version for s in kept] == [8, 9] and dropped == 3
    kept, dropped = drop_stale(samples, 8, 1, floor=7)
    assert [s.policy_version for s in kept] == [0, 5, 7, 8, 9] and dropped == 0
    assert drop_stale(samples, 8, 1)[1] == 2  # without a floor: v0 and v5 by number


def test_wiped_learner_numbers_above_what_vllm_serves(model_dir: Path, tmp_path: Path) -> None:
    announced: list[Path] = []
    first = learner(tmp_path, model_dir, announced, ["base", "policy-v1", "policy-v7"])
    first.run(max_steps=1)
    store = AdapterStore(tmp_path)
    assert [p.name for p in announced] == ["policy-v8"] and store.versions() == [8]
    meta = store.read_meta(8)
    assert meta["parent_version"] == 0 and meta["version_floor"] == 7

    # Restarted with only our own version served: the floor is kept (checkpoint), and the
    # base-served samples are one generation old, not eight, so they still train.
    second = learner(tmp_path, model_dir, announced, ["base", "policy-v8"])
    assert (second.version, second.version_floor) == (8, 7)
    summary = second.run(max_steps=1)
    assert summary.version == 9 and summary.counts.get("stale", 0) == 0
    assert [p.name for p in announced] == ["policy-v8", "policy-v9"]
    assert store.read_meta(9)["parent_version"] == 8

    # A lost checkpoint rolls forward from the store, which carries the floor too.
    CheckpointStore(tmp_path).path.unlink()
    plan = resume_plan(None, store)
    assert (plan.version, plan.version_floor) == (9, 7)


def test_names_a_state_dir_announced_are_not_used_again(model_dir: Path, tmp_path: Path) -> None:
    """Retraining from an older checkpoint: the operator restores it and moves the newer
    directories aside. Nothing serves them, so the served names did not raise the floor:
    the next version was `policy-v2` again, and the promoter, whose `decided.json` said 2,
    dropped it as already decided: never gated, never promoted."""
    announced: list[Path] = []
    learner(tmp_path, model_dir, announced, ["base"]).run(max_steps=1)
    checkpoints = CheckpointStore(tmp_path)
    kept = checkpoints.path.read_bytes()  # the operator's backup of v1's checkpoint
    learner(tmp_path, model_dir, announced, ["base"]).run(max_steps=1)
    assert [p.name for p in announced] == ["policy-v1", "policy-v2"]
    checkpoints.mark_decided(2)  # its gate rejected it
    checkpoints.path.write_bytes(kept)
    store = AdapterStore(tmp_path)
    store.path(2).rename(tmp_path / "policy-v2.moved-aside")

    again = learner(tmp_path, model_dir, announced, ["base"])
    assert (again.version, again.version_floor) == (1, 2)
    again.run(max_steps=1)
    assert [p.name for p in announced] == ["policy-v1", "policy-v2", "policy-v3"]
    assert store.read_meta(3)["parent_version"] == 1
    assert checkpoints.announced() == 3 and checkpoints.decided() == 2  # v3 is gated


def test_real_vllm_listing_sets_the_next_name(
    vllm_server: VllmServer,
    model_dir: Path,
    tmp_path: Path,
    make_lora_adapter: Callable[..., Path],
) -> None:
    """A `policy-v3` left loaded in vLLM (a wiped learner's): the new learner's first
    candidate is `policy-v4`, which vLLM then loads as a new adapter."""
    replicas = ReplicaSet([vllm_server.base_url])
    old = make_lora_adapter(tmp_path / "old", seed=3)
    replicas.load("policy-v3", old)
    announced: list[Path] = []
    try:
        new = Learner(
            config(),
            tmp_path / "state",
            lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
            model_dir=model_dir,
            on_candidate=announced.append,
            served_versions=lambda: served_versions(replicas, wait_s=0),
        )
        assert new.version_floor == 3
        new.run(max_steps=1)
        assert [p.name for p in announced] == ["policy-v4"]
        replicas.load("policy-v4", announced[0])
        assert {"policy-v3", "policy-v4"} <= replicas.served(vllm_server.base_url)
    finally:
        for name in ("policy-v3", "policy-v4"):
            replicas.unload(name)
        replicas.close()


def test_the_proxy_names_count_for_the_floor() -> None:
    """Under `olp up` vLLM starts empty: a floor from its listing alone let a learner whose
    own version is 7 name new versions v8, v9 while the alias still targeted the gated v9
    (its directory moved aside), and the reloader then served the new, ungated v9 weights
    behind the alias."""
    status = {
        "aliases": {"policy": "policy-v9", "other": "base"},
        "canaries": {"policy": {"target": "policy-v10", "share": 0.1}},
        "rollback_targets": {"policy": "policy-v8"},
        "serving_version": "policy-v9",
        "history": [
            {"kind": "flip", "target": "policy-v12", "previous": "policy-v11"},
            {"kind": "canary_rollback", "target": "policy-v13", "note": "policy-v14-ish"},
        ],
        "upstreams": ["http://policy-v99"],
    }
    names = named_versions(status)
    assert names == {f"policy-v{n}" for n in (8, 9, 10, 11, 12, 13)}
    assert raise_version_floor(0, 7, names) == 13


def test_the_learner_is_told_the_versions_the_proxy_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`olp learner` hands the learner vLLM's listing and the proxy's names together."""
    built = fakes(monkeypatch, tmp_path, rank=0, world=1)
    monkeypatch.setattr(learner_runner, "served_versions", lambda replicas, **_: {"policy-v1"})
    assert learner_runner.run(OlpConfig(state_dir=tmp_path)) == 0
    names = set(built.learner_kwargs["served_versions"]())
    assert names == {"policy-v1", "policy-v2", "policy-v3", "policy-v4"}


def test_a_proxy_that_does_not_answer_stops_the_learner() -> None:
    """Without the proxy's names the next version might reuse one: not knowing is fatal,
    as for vLLM's listing."""

    class Down:
        def status(self) -> dict:
            raise httpx.ConnectError("connection refused")

    with pytest.raises(SystemExit, match="cannot read the proxy's status"):
        proxy_versions(Down(), wait_s=0)  # type: ignore[arg-type]
    # A stop while it waits ends the wait at once, as a stop (exit 0), not the failure.
    stop = threading.Event()
    stop.set()
    with pytest.raises(SystemExit) as stopped:
        proxy_versions(Down(), wait_s=60, stop=stop)  # type: ignore[arg-type]
    assert stopped.value.code == 0


def test_a_failing_on_started_closes_the_learner_it_started(
    model_dir: Path, tmp_path: Path
) -> None:
    """`on_started` (the promoter's resume) raising left the new learner's consumer (Kafka
    sockets, a producer thread) and judge open: only `run` closed them."""
    from learner.service import run_learner

    sources: list[ListSource] = []

    def consumer(offsets: Any, rank: int, world: int) -> ListSource:
        sources.append(ListSource({0: RECORDS}, offsets))
        return sources[-1]

    def resume_fails() -> None:
        raise RuntimeError("the promoter's resume failed")

    with pytest.raises(RuntimeError, match="resume failed"):
        run_learner(config(), tmp_path, consumer, model_dir=model_dir, on_started=resume_fails)
    assert [source.closed for source in sources] == [True]


class ArrivingLater(ListSource):
    """Nothing for `idle_s`, then one trajectory every 50 ms, one a poll at most (a poll
    that a loaded machine delays past two arrivals must not fill a batch past its size)."""

    def __init__(self, *args: Any, idle_s: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.opened = time.monotonic()
        self.idle_s = idle_s

    def poll(self, timeout_s: float) -> list[dict[str, Any]]:
        time.sleep(0.02)
        due = int(max(0.0, time.monotonic() - self.opened - self.idle_s) / 0.05)
        out = []
        for p, items in self.partitions.items():
            if self.next[p] < min(due, len(items)) and not out:
                out.append(items[self.next[p]])
                self.next[p] += 1
        return out


def test_the_batch_timeout_counts_from_the_batchs_first_trajectory(
    model_dir: Path, tmp_path: Path
) -> None:
    """Counted from the last step (or the start), a learner that had been quiet for longer
    than `batch_timeout_s` trained the first `min_batch` trajectories of the next burst at
    once, as a version (and a gate run) of their own, though the burst filled a batch a
    moment later (batches of 2, 8, 8 for bursts of 8)."""
    cfg = config().model_copy(update={"batch_size": 4, "min_batch": 2, "batch_timeout_s": 1.0})
    learner = Learner(
        cfg,
        tmp_path,
        lambda offsets, rank, world: ArrivingLater({0: RECORDS}, offsets, idle_s=1.5),
        model_dir=model_dir,
    )
    summary = learner.run(max_steps=1, poll_timeout_s=0.02)
    assert summary.steps == 1
    assert AdapterStore(tmp_path).read_meta(1)["data_stats"]["trajectories"] == 4


def test_a_training_step_that_raises_is_put_back_and_its_batch_consumed(
    model_dir: Path, tmp_path: Path
) -> None:
    """Only a stop was caught around the step: an out-of-memory on one long sample left
    the learner before its checkpoint, and the same batch killed it at every restart."""
    import torch

    def make() -> Learner:
        return Learner(
            config(),
            tmp_path,
            lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
            model_dir=model_dir,
        )

    learner = make()
    before = learner.trainer.adapter_state()

    def out_of_memory(*args: Any, **kwargs: Any) -> dict[str, float]:
        with torch.no_grad():  # an update applied before the failure
            for parameter in learner.trainer.model.parameters():
                if parameter.requires_grad:
                    parameter.add_(1.0)
        raise RuntimeError("CUDA out of memory")

    learner.trainer.step = out_of_memory  # type: ignore[method-assign]
    summary = learner.run(max_steps=1)
    assert summary.version == 0 and summary.counts["step_failed"] > 0
    after = learner.trainer.adapter_state()
    assert all(torch.equal(before[name], after[name]) for name in before)
    # The next start goes on after that batch, and trains.
    again = make()
    assert again.offsets == {"mem.trajectories": {0: 4}}
    assert again.run(max_steps=1).version == 1
