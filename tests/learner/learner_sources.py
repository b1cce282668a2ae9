"""Test helpers: an in-memory partitioned source with the TrajectoryConsumer interface.

Used where the test is about the learner's bookkeeping (crash/resume, ranks) rather than
about the broker; the broker path is covered by test_learner_learning.py.
"""

from __future__ import annotations

from typing import Any


class ListSource:
    """Partitions of ScoredTrajectory-shaped dicts; offsets like replay's consumer."""

    def __init__(
        self,
        partitions: dict[int, list[dict[str, Any]]],
        offsets: dict[str, dict[int, int]] | None,
        rank: int = 0,
        world: int = 1,
        topic: str = "mem.trajectories",
        per_poll: int = 4,
    ) -> None:
        self.topic = topic
        self.partitions = {p: items for p, items in partitions.items() if p % world == rank}
        start = (offsets or {}).get(topic, {})
        self.next = {p: int(start.get(p, 0)) for p in self.partitions}
        self.per_poll = per_poll
        self.closed = False

    def poll(self, timeout_s: float) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p, items in sorted(self.partitions.items()):
            while self.next[p] < len(items) and len(out) < self.per_poll:
                out.append(items[self.next[p]])
                self.next[p] += 1
        return out

    def processed_offsets(self) -> dict[str, dict[int, int]]:
        return {self.topic: dict(self.next)}

    def close(self) -> None:
        self.closed = True


def synthetic_scored(index: int, n_choices: int = 2, prompt_len: int = 6) -> dict[str, Any]:
    """A trajectory with `n_choices` choices and score feedback that differs per choice."""
    prompt = [(index * 7 + j) % 500 + 10 for j in range(prompt_len)]
    choices = []
    feedback = []
    for c in range(n_choices):
        ids = [(index * 13 + c * 5 + k) % 500 + 10 for k in range(3 + c)]
        choices.append(
            {
                "index": c,
                "message": {"role": "assistant", "content": "x"},
                "finish_reason": "stop",
                "token_ids": ids,
                "logprobs": [-2.0] * len(ids),
            }
        )
        feedback.append(
            {
                "kind": "score",
                "value": float(c == index % n_choices),
                "choice_index": c,
                "trajectory_id": f"t{index}",
            }
        )
    trajectory = {
        "schema_version": 1,
        "event_id": f"e{index}",
        "trajectory_id": f"t{index}",
        "session_id": f"s{index}",
        "tenant": "A",
        "user": None,
        "task": "syn",
        "policy_version": "base",
        "group_id": None,
        "status": "ok",
        "trainable": True,
        "request": {"messages": [{"role": "user", "content": "hi"}]},
        "prompt_token_ids": prompt,
        "choices": choices,
    }
    return {"trajectory": trajectory, "feedback": feedback}
