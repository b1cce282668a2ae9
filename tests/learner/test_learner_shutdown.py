"""The learner releases the judge's worker threads and HTTP client when it stops: returning,
raising, or failing to start (a tiny random Llama; the judge is never called)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from learner import service
from learner.adapter_store import AdapterStore
from learner.config import JudgeConfig, LearnerConfig, RewardConfig
from learner.rewards.assembler import RewardAssembler
from learner.rewards.judge import Judge
from learner.service import Learner
from tests.learner.learner_sources import ListSource, synthetic_scored

RECORDS = [synthetic_scored(i) for i in range(4)]
# Nothing listens there; no test reaches the judge (it scores only inside a step).
JUDGE = JudgeConfig(enabled=True, base_url="http://127.0.0.1:9/v1")


def released(judge: Judge) -> bool:
    """Its worker threads are shut down and its HTTP client is closed."""
    try:
        judge._pool.submit(lambda: None)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return judge._client.is_closed()
    return False


@pytest.fixture
def judges(monkeypatch: pytest.MonkeyPatch) -> list[Judge]:
    """Every Judge the learner builds."""
    built: list[Judge] = []

    class Recorded(Judge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(service, "Judge", Recorded)
    return built


def config() -> LearnerConfig:
    return LearnerConfig(
        batch_size=64,  # never reached: no step runs
        min_batch=64,
        lora_rank=4,
        lora_alpha=8,
        progress_interval_s=60,
        rewards=RewardConfig(judge=JUDGE),
    )


def test_the_judge_is_released_when_the_learner_stops(
    tiny_model: Path, tmp_path: Path, judges: list[Judge]
) -> None:
    """Nothing closed the judge: its threads and connections lived as long as the process."""
    source = ListSource({0: RECORDS}, None)
    learner = Learner(config(), tmp_path, lambda *_: source, model_dir=tiny_model)
    stop = threading.Event()
    stop.set()
    learner.run(stop=stop, poll_timeout_s=0.01)
    assert len(judges) == 1 and released(judges[0])
    assert source.closed
    learner.close()  # idempotent


def test_the_judge_is_released_when_the_loop_raises(
    tiny_model: Path, tmp_path: Path, judges: list[Judge]
) -> None:
    class Broken(ListSource):
        def poll(self, timeout_s: float) -> list[dict[str, Any]]:
            raise ConnectionError("broker gone")

    source = Broken({0: RECORDS}, None)
    learner = Learner(config(), tmp_path, lambda *_: source, model_dir=tiny_model)
    with pytest.raises(ConnectionError):
        learner.run(poll_timeout_s=0.01)
    assert len(judges) == 1 and released(judges[0]) and source.closed


def test_the_judge_is_released_when_start_up_fails(
    tiny_model: Path, tmp_path: Path, judges: list[Judge]
) -> None:
    def no_consumer(*args: Any) -> ListSource:
        raise ConnectionError("no broker")

    with pytest.raises(ConnectionError):
        Learner(config(), tmp_path, no_consumer, model_dir=tiny_model)
    assert len(judges) == 1 and released(judges[0])


def test_a_bad_verifier_path_fails_start_up_before_a_judge_exists(
    tmp_path: Path, judges: list[Judge]
) -> None:
    rewards = RewardConfig(judge=JUDGE, verifiers=[{"path": "no_such_module:verify"}])
    bad = config().model_copy(update={"rewards": rewards})
    with pytest.raises(ValueError, match=r"learner\.rewards\.verifiers\[0\]\.path"):
        Learner(bad, tmp_path, lambda *_: ListSource({0: RECORDS}, None), model_dir=tmp_path)
    assert judges == []


def test_the_assembler_closes_its_judge_once() -> None:
    judge = Judge(JUDGE)
    assembler = RewardAssembler(RewardConfig(judge=JUDGE), judge=judge)
    assembler.close()
    assert released(judge)
    assembler.close()  # a second close is harmless
    judge.close()
    RewardAssembler(RewardConfig()).close()  # no judge: nothing to close


def learner_on_records(
    settings: LearnerConfig, state: Path, model: Path, announced: list[Path]
) -> Learner:
    """A learner reading RECORDS from where its state's checkpoint left off."""
    return Learner(
        settings,
        state,
        lambda offsets, *_: ListSource({0: RECORDS}, offsets),
        model_dir=model,
        on_candidate=announced.append,
    )


def assert_the_batch_is_trained_at_the_next_start(
    settings: LearnerConfig, state: Path, model: Path, announced: list[Path]
) -> None:
    """After an interrupted step: no version was made, and the next start trains the same
    four records into policy-v1."""
    assert announced == [] and AdapterStore(state).latest() is None
    again = learner_on_records(settings, state, model, announced).run(
        max_steps=1, poll_timeout_s=0.01
    )
    assert again.version == 1 and [p.name for p in announced] == ["policy-v1"]
    meta = AdapterStore(state).read_meta(1)
    assert meta["data_stats"]["trajectories"] == 4  # the interrupted batch, not lost
    assert meta["consumed_offsets"] == {"mem.trajectories": {"0": 4}}


def test_a_stop_during_a_step_ends_it_with_no_version_and_the_batch_is_read_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step runs for about a minute on a CPU and the learner finished it before looking
    at `stop`, so `olp up` (which waits 30 s) killed it on Ctrl-C."""
    from learner import trainer as trainer_module

    settings = LearnerConfig(
        batch_size=4,
        min_batch=4,
        micro_batch_size=1,  # four micro-batches: a stop after the first ends the step
        updates_per_batch=2,
        lora_rank=4,
        lora_alpha=8,
        progress_interval_s=60,
    )
    stop = threading.Event()
    losses = {"n": 0}
    real_loss = trainer_module.policy_loss

    def loss_then_stop(*args: Any, **kwargs: Any) -> Any:
        losses["n"] += 1
        stop.set()  # Ctrl-C arrives during the first micro-batch
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "policy_loss", loss_then_stop)
    announced: list[Path] = []
    first = learner_on_records(settings, tmp_path, tiny_model, announced)
    summary = first.run(stop=stop, poll_timeout_s=0.01)
    assert losses["n"] == 1  # left before the second micro-batch
    assert summary.version == 0 and summary.steps == 0

    monkeypatch.setattr(trainer_module, "policy_loss", real_loss)
    assert_the_batch_is_trained_at_the_next_start(settings, tmp_path, tiny_model, announced)


def test_a_step_already_stopped_trains_nothing(tiny_model: Path, tmp_path: Path) -> None:
    from learner.trainer import StepInterrupted

    settings = LearnerConfig(lora_rank=4, lora_alpha=8, progress_interval_s=60)
    learner = Learner(
        settings, tmp_path, lambda *_: ListSource({0: []}, None), model_dir=tiny_model
    )
    stop = threading.Event()
    stop.set()
    before = {k: v.clone() for k, v in learner.trainer.adapter_state().items()}
    samples, _ = service.samples_from_rewarded(learner.assembler.assemble(RECORDS), "base")
    with pytest.raises(StepInterrupted, match="update 1 of 1"):
        learner.trainer.step(samples, 0, stop)
    after = learner.trainer.adapter_state()
    assert all(before[k].equal(after[k]) for k in before)
    learner.close()


def test_a_stop_while_rewards_are_assembled_ends_the_step_and_the_batch_is_read_again(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewards come before the step: a judge or verifiers that take their timeout per call
    held a stopping learner for the whole batch."""
    settings = config().model_copy(update={"batch_size": 4, "min_batch": 4, "micro_batch_size": 4})
    stop = threading.Event()
    asked: list[str] = []

    class StopsTheLearner(Judge):
        def score(self, trajectory: dict[str, Any], choice: dict[str, Any], stop_=None) -> Any:
            asked.append(trajectory["trajectory_id"])
            stop.set()  # Ctrl-C arrives while the first reply is judged
            return super().score(trajectory, choice, stop_)

    monkeypatch.setattr(service, "Judge", StopsTheLearner)
    announced: list[Path] = []
    first = learner_on_records(settings, tmp_path, tiny_model, announced)
    summary = first.run(stop=stop, poll_timeout_s=0.01)
    assert len(set(asked)) == 1  # one group's replies (asked at once), no further group
    assert first.assembler.judge is not None and first.assembler.judge.calls == 0
    assert summary.version == 0 and summary.steps == 0
    assert "reward_judge_failed" not in summary.counts

    monkeypatch.setattr(service, "Judge", Judge)
    no_judge = settings.model_copy(update={"rewards": RewardConfig()})
    assert_the_batch_is_trained_at_the_next_start(no_judge, tmp_path, tiny_model, announced)
