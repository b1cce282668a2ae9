"""The learner releases the judge's worker threads and HTTP client when it stops: returning,
raising, or failing to start (a tiny random Llama; the judge is never called)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from learner import service
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
