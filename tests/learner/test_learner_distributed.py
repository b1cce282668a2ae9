"""2-rank torchrun on CPU (gloo): disjoint partitions, summed gradients, identical weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from deploy.ports import free_port
from learner.adapter_store import AdapterStore
from learner.distributed import DistContext
from learner.objective import (
    RunningBaseline,
    Sample,
    apply_share_caps_across_ranks,
    assign_advantages,
    assign_advantages_across_ranks,
)
from safety.config import CapsConfig

HERE = Path(__file__).parent


@pytest.mark.slow
def test_two_rank_torchrun_ends_with_identical_weights(model_dir: Path, tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent.parent)])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),  # port 0 makes the c10d rendezvous hang
            str(HERE / "torchrun_worker.py"),
            str(state),
            str(model_dir),
            str(out),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can stop torchrun *and* its workers
    )
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail("torchrun did not finish in 420 s:\n" + stderr[-3000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    rank0, rank1 = (
        load_file(str(out / "rank0.safetensors")),
        load_file(str(out / "rank1.safetensors")),
    )
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert any(rank0[k].abs().sum() > 0 for k in rank0 if "lora_B" in k)  # it trained
    store = AdapterStore(state)
    assert store.versions() == [1, 2]
    published = load_file(str(store.path(2) / "adapter_model.safetensors"))
    for key, value in published.items():
        match = [k for k in rank0 if k.replace(".default", "") == key.replace(".default", "")]
        assert match and torch.equal(value, rank0[match[0]]), key
    ids = (
        store.read_meta(1)["data_stats"]["event_ids"]
        + store.read_meta(2)["data_stats"]["event_ids"]
    )
    assert sorted(ids) == sorted({f"e{p * 100 + i}" for p in range(2) for i in range(8)})
    assert store.read_meta(2)["consumed_offsets"] == {"mem.trajectories": {"0": 8, "1": 8}}


def _torchrun_env(rank: int, world: int, port: int) -> None:
    """The variables torchrun gives each rank, which `init_distributed` reads."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )


def _gpu_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of `init_distributed` as on a GPU machine, NCCL played by gloo registered
    for CUDA tensors only (what NCCL is registered for), then the collectives the learner
    loop runs on CPU tensors and objects."""
    import learner.distributed as distributed

    _torchrun_env(rank, world, port)
    dist.Backend.register_backend(
        "cudaonly",
        lambda store, r, size, timeout: dist.ProcessGroupGloo(store, r, size, timeout),
        devices=["cuda"],
    )
    join = dist.init_process_group

    def init_process_group(backend: str, **kwargs: object) -> None:
        join(backend.replace("nccl", "cudaonly"), timeout=timedelta(seconds=60), **kwargs)

    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    distributed.dist.init_process_group = init_process_group  # type: ignore[assignment]
    try:
        ctx = distributed.init_distributed()
        flags = torch.tensor([float(rank + 3), float(rank)], dtype=torch.float64)
        distributed.all_reduce_sum(ctx, flags[:1])  # as Learner.run does
        distributed.all_reduce_max(ctx, flags[1:])
        seen = distributed.all_gather_object(ctx, rank)
        told = distributed.broadcast_object(ctx, "from 0" if ctx.is_main else None)
        distributed.barrier(ctx)
        result = {"device": str(ctx.device), "flags": flags.tolist(), "seen": seen, "told": told}
    except Exception as exc:  # reported by the test, not lost in the spawned process
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_gpu_group_carries_the_cpu_collectives(tmp_path: Path) -> None:
    """On GPU the group was NCCL alone, registered for CUDA tensors only: the loop's first
    all-reduce of its CPU flags raised "No backend type associated with device type cpu"
    on every rank, so multi-GPU torchrun never trained."""
    mp.start_processes(
        _gpu_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result == {
            "device": f"cuda:{rank}",
            "flags": [7.0, 1.0],
            "seen": [0, 1],
            "told": "from 0",
        }, result


def _sample(i: int, tenant: str, user: str | None) -> Sample:
    return Sample(f"t{i}:0", f"e{i}", [1], [2], [-1.0], 1.0, None, "x", tenant, user, 0)


def _caps_rank(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank: tenant A's sessions all on rank 0, tenant B's on rank 1."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        if rank == 0:
            samples = [_sample(i, "A", f"a{i % 4}") for i in range(24)]
        else:
            samples = [_sample(100 + i, "B", f"b{i % 4}") for i in range(8)]
        kept, counts = apply_share_caps_across_ranks(
            DistContext(rank, world), samples, CapsConfig()
        )
        Path(out, f"rank{rank}.txt").write_text(f"{len(kept)} {counts['capped']}")
    finally:
        dist.destroy_process_group()


def test_share_caps_apply_to_the_union_of_the_ranks(tmp_path: Path) -> None:
    mp.start_processes(
        _caps_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    # Capped per rank, A would keep all 24 (alone on its rank); over the trained union
    # (32) A may keep at most half of what is kept.
    assert (tmp_path / "rank0.txt").read_text() == "8 16"
    assert (tmp_path / "rank1.txt").read_text() == "8 0"


def _scored(i: int, reward: float, group: str | None = None) -> Sample:
    return Sample(f"t{i}:0", f"e{i}", [1], [2], [-1.0], reward, group, "x", "A", None, 0)


def _rank_samples(rank: int) -> list[Sample]:
    """Task x's sessions on both ranks, group g's replies split over them."""
    if rank == 0:
        return [_scored(0, 1.0), _scored(1, 0.0), _scored(2, 1.0, "g"), _scored(3, 1.0, "g")]
    return [_scored(10, 0.0), _scored(11, 1.0), _scored(12, 0.0, "g")]


def _advantage_rank(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        baseline = RunningBaseline(decay=0.5)
        kept, counts = assign_advantages_across_ranks(
            DistContext(rank, world), _rank_samples(rank), baseline
        )
        result = {
            "baseline": baseline.values,
            "advantages": {s.key: s.advantage for s in kept},
            "counts": counts,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_advantages_use_one_baseline_over_the_ranks(tmp_path: Path) -> None:
    """Each rank kept its own running baseline (and group means) over its own partitions:
    the ranks' baselines diverged, and only rank 0's reached the checkpoint."""
    mp.start_processes(
        _advantage_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    whole = RunningBaseline(decay=0.5)
    kept, counts = assign_advantages(_rank_samples(0) + _rank_samples(1), whole)
    assert ranks[0]["baseline"] == ranks[1]["baseline"] == whole.values
    assert {**ranks[0]["advantages"], **ranks[1]["advantages"]} == {
        s.key: s.advantage for s in kept
    }
    assert set(ranks[0]["advantages"]) == {"t1:0", "t2:0", "t3:0"}  # t0 sets the baseline
    summed = {k: ranks[0]["counts"][k] + ranks[1]["counts"][k] for k in counts}
    assert summed == counts


# -- the canary's evidence: rank 0's monitor counts every rank's replies ----------------------


def _reply(version: str, text: str, reward: float | None, created_at: float = 10.0):
    from learner.rewards.assembler import RewardedChoice

    trajectory = {
        "policy_version": version,
        "created_at": created_at,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
    }
    return RewardedChoice(trajectory=trajectory, choice_index=0, reward=reward)


def _init_gloo(rank: int, world: int, port: int) -> None:
    # A collective one rank skips fails after the timeout instead of hanging the test.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _evidence_rank(rank: int, world: int, port: int, out: str) -> None:
    from learner.canary import CanaryMonitor, share_canary_evidence

    _init_gloo(rank, world, port)
    try:
        ctx = DistContext(rank, world)
        # Rank 1 holds a monitor too, never begun: only rank 0's counts, and rank 1's must
        # not decide whether a rank joins the gather.
        monitor = CanaryMonitor()
        if rank == 0:
            monitor.begin(["base", "policy-v2"], since=5.0)
            batches = [
                [_reply("base", "The answer is four.", 1.0), _reply("policy-v2", "Four.", 0.5)],
                [_reply("policy-v2", "Four!", 1.0)],
                [_reply("base", "Four.", 1.0)],
                [_reply("base", "Four.", 1.0)],
            ]
        else:
            batches = [
                [
                    _reply("base", "I'm sorry, I cannot help with that.", 0.0),
                    _reply("policy-v2", "Four.", 0.0),
                    _reply("policy-v2", "Four.", 0.0, created_at=1.0),  # before the canary
                    _reply("policy-v1", "Four.", 0.0),  # no arm of this canary
                ],
                [],  # an empty batch still joins the collectives
                [_reply("base", "Four.", 1.0, created_at="garbage")],  # type: ignore[arg-type]
                [_reply("base", "Four.", 1.0)],
            ]
        counts = []
        for step, batch in enumerate(batches):
            if step == 3 and rank == 0:
                monitor.end()  # no canary now: nothing gathered, on either rank
            share_canary_evidence(ctx, monitor, batch)
            stats = [monitor.arm(v) for v in ("base", "policy-v2")]
            counts.append(
                [[s.samples, s.rewarded, s.reward_sum, s.flags["refusal"]] for s in stats]
            )
        Path(out, f"rank{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def test_the_canary_on_rank_0_counts_the_replies_of_every_rank(tmp_path: Path) -> None:
    """Each rank's learner fed its own canary its own rewarded batch: rank 0's canary (the
    promoter's) saw rank 0's share of the live evidence only, half of it with 2 ranks."""
    mp.start_processes(
        _evidence_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    # Step 1: both ranks' replies inside the window (rank 1's refusal among them).
    assert rank0[0] == [[2, 2, 1.0, 1], [2, 2, 0.5, 0]]
    assert rank0[1] == [[2, 2, 1.0, 1], [3, 3, 1.5, 0]]  # rank 1's batch was empty
    # A record rank 1 cannot read costs rank 1's share of that batch, nothing more.
    assert rank0[2] == [[3, 3, 2.0, 1], [3, 3, 1.5, 0]]
    assert rank0[3] == [[0, 0, 0.0, 0], [0, 0, 0.0, 0]]  # ended: nothing counted
    assert all(step == [[0, 0, 0.0, 0], [0, 0, 0.0, 0]] for step in rank1)


def _learner_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    from learner.canary import CanaryMonitor
    from learner.config import LearnerConfig
    from learner.service import Learner
    from tests.learner.learner_sources import ListSource, synthetic_scored

    _init_gloo(rank, world, port)
    try:
        partitions = {p: [synthetic_scored(p * 100 + i) for i in range(4)] for p in range(2)}
        config = LearnerConfig(
            batch_size=8,
            min_batch=1,
            micro_batch_size=4,
            lr=1e-3,
            num_threads=1,
            progress_interval_s=60,
            lora_rank=4,
            lora_alpha=8,
        )
        canary = CanaryMonitor() if rank == 0 else None  # the runner's: rank 0 only
        if canary is not None:
            canary.begin(["base"], since=0.0)
        learner = Learner(
            config,
            Path(out) / "state",
            lambda offsets, r, w: ListSource(partitions, offsets, r, w),
            model_dir=model,
            ctx=DistContext(rank, world),
            canary=canary,
        )
        summary = learner.run(max_steps=1)
        arm = canary.arm("base").to_dict() if canary is not None else None
        result = {"steps": summary.steps, "consumed": summary.consumed, "arm": arm}
        Path(out, f"learner{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_ranks_feed_one_canary_on_rank_0(tiny_model: Path, tmp_path: Path) -> None:
    """The learner loop end to end under two gloo ranks: rank 0's canary counts the
    replies of both ranks' partitions (4 records of 2 choices each per rank)."""
    mp.start_processes(
        _learner_rank,
        args=(2, free_port(), str(tiny_model), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    rank0 = json.loads((tmp_path / "learner0.json").read_text())
    rank1 = json.loads((tmp_path / "learner1.json").read_text())
    assert rank0["steps"] == rank1["steps"] == 1
    assert rank0["consumed"] == rank1["consumed"] == 8  # what every rank read
    assert rank0["arm"]["samples"] == 16 and rank0["arm"]["rewarded"] == 16
    assert rank1["arm"] is None


def _rank_learner(
    config: Any, partitions: dict[int, list[Any]], model: str, out: str, rank: int, world: int
) -> Any:
    """A Learner of one rank reading `partitions` (its share of them), state under `out`."""
    from learner.service import Learner
    from tests.learner.learner_sources import ListSource

    return Learner(
        config,
        Path(out) / "state",
        lambda offsets, r, w: ListSource(partitions, offsets, r, w),
        model_dir=model,
        ctx=DistContext(rank, world),
    )


def _stale_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    from structlog.testing import capture_logs

    from learner.config import LearnerConfig
    from tests.learner.learner_sources import synthetic_scored

    _init_gloo(rank, world, port)
    try:
        # Partition 1 only, which rank 1 reads: rank 0's partitions carry no traffic.
        partitions = {1: [synthetic_scored(i) for i in range(4)]}
        config = LearnerConfig(
            batch_size=4, min_batch=1, max_staleness=4, num_threads=1,
            progress_interval_s=600, lora_rank=4, lora_alpha=8,
        )  # fmt: skip
        learner = _rank_learner(config, partitions, model, out, rank, world)
        learner.version = 5  # resumed 5 versions ahead of the base that served the records
        with capture_logs() as logs:
            summary = learner.run(max_steps=1)
        warnings = [e for e in logs if e["event"] == "learner_ahead_of_serving"]
        result = {
            "consumed": summary.consumed,
            "stale": summary.counts.get("stale"),
            "warnings": [[e["stale"], e["newest_served"]] for e in warnings],
        }
        Path(out, f"stale{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_a_learner_ahead_of_serving_says_so_whichever_rank_read_the_batch(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Rank 0 decided from its own samples: with the stale batch on rank 1 the learner
    trained nothing, never said why, and its progress line said it consumed nothing."""
    mp.start_processes(
        _stale_rank,
        args=(2, free_port(), str(tiny_model), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    rank0 = json.loads((tmp_path / "stale0.json").read_text())
    rank1 = json.loads((tmp_path / "stale1.json").read_text())
    assert rank0["stale"] == rank1["stale"] == 8  # 4 records of 2 replies, all on rank 1
    assert rank0["warnings"] == [[8, 0]]  # said once, by rank 0, of the whole batch
    assert rank1["warnings"] == []
    assert rank0["consumed"] == rank1["consumed"] == 4


def _refused_offsets_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    from learner.config import LearnerConfig
    from learner.service import Learner
    from tests.learner.learner_sources import ListSource, synthetic_scored

    _init_gloo(rank, world, port)
    try:
        partitions = {p: [synthetic_scored(p * 100 + i) for i in range(4)] for p in range(2)}
        announced: list[str] = []

        def consumer(offsets: Any, r: int, w: int) -> Any:
            if r == 1:  # as TrajectoryConsumer refuses offsets past its partitions' ends
                raise RuntimeError("saved offsets lie past the end of the stream (rank 1)")
            return ListSource(partitions, offsets, r, w)

        config = LearnerConfig(
            batch_size=4, min_batch=1, num_threads=1, progress_interval_s=600, lora_rank=4,
            lora_alpha=8,
        )  # fmt: skip
        try:
            Learner(
                config,
                Path(out) / "state",
                consumer,
                model_dir=model,
                on_candidate=lambda path: announced.append(path.name),
                ctx=DistContext(rank, world),
            )
            said = "started"
        except RuntimeError as exc:
            said = str(exc)
        Path(out, f"refused{rank}.json").write_text(json.dumps([said, announced]))
    finally:
        dist.destroy_process_group()


def test_offsets_one_rank_refuses_stop_every_rank_before_any_announce(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Each rank's consumer checks the offsets of its own partitions: with rank 1's
    refusing, rank 0 went on and handed the pending candidate to the promoter."""
    from learner.config import LearnerConfig
    from learner.service import Learner
    from tests.learner.learner_sources import ListSource, synthetic_scored

    partitions = {p: [synthetic_scored(p * 100 + i) for i in range(4)] for p in range(2)}

    def crash(stage: str) -> None:
        if stage == "after_publish":
            raise RuntimeError("a crash between the publish and the announce")

    config = LearnerConfig(
        batch_size=4, min_batch=1, num_threads=1, progress_interval_s=600, lora_rank=4,
        lora_alpha=8,
    )  # fmt: skip
    single = Learner(
        config,
        tmp_path / "state",
        lambda offsets, r, w: ListSource(partitions, offsets, r, w),
        model_dir=tiny_model,
        fault_hook=crash,
    )
    with pytest.raises(RuntimeError, match="between the publish"):
        single.run(max_steps=1)
    mp.start_processes(
        _refused_offsets_rank,
        args=(2, free_port(), str(tiny_model), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in range(2):
        said, announced = json.loads((tmp_path / f"refused{rank}.json").read_text())
        assert said == "saved offsets lie past the end of the stream (rank 1)", (rank, said)
        assert announced == [], rank


def _held_elsewhere_rank(rank: int, world: int, port: int, out: str) -> None:
    from learner.distributed import held_elsewhere

    _init_gloo(rank, world, port)
    try:
        keys = [{"split", "only-0"}, {"split", "only-1"}, set()][rank]
        found = held_elsewhere(DistContext(rank, world), keys)
        Path(out, f"rank{rank}.json").write_text(json.dumps(sorted(found)))
    finally:
        dist.destroy_process_group()


def test_a_judge_group_split_over_ranks_is_known_to_each_rank_holding_it(
    tmp_path: Path,
) -> None:
    mp.start_processes(
        _held_elsewhere_rank, args=(3, free_port(), str(tmp_path)), nprocs=3, start_method="spawn"
    )
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert found == [["split"], ["split"], []]


def _stopping_rank(rank: int, world: int, port: int, model: str, out: str) -> None:
    import threading

    import learner.trainer as trainer_module
    from learner.config import LearnerConfig
    from tests.learner.learner_sources import synthetic_scored

    _init_gloo(rank, world, port)
    try:
        stop = threading.Event()
        loss = trainer_module.policy_loss

        def stopped_meanwhile(*args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                stop.set()  # the signal arrives while rank 0 trains its first micro-batch
            return loss(*args, **kwargs)

        trainer_module.policy_loss = stopped_meanwhile
        # Rank 1 has fewer micro-batches than rank 0: it still meets every stop check.
        partitions = {0: [synthetic_scored(i) for i in range(6)], 1: [synthetic_scored(100)]}
        config = LearnerConfig(
            batch_size=7, min_batch=7, micro_batch_size=2, lr=1e-3, num_threads=1,
            progress_interval_s=600, lora_rank=4, lora_alpha=8, batch_timeout_s=60,
        )  # fmt: skip
        learner = _rank_learner(config, partitions, model, out, rank, world)
        summary = learner.run(stop=stop, max_steps=1, poll_timeout_s=0.05)
        result = {"version": summary.version, "published": learner.store.versions()}
        Path(out, f"stopped{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_a_stop_during_the_update_stops_every_rank_without_a_version(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Ranks agreed on a stop only at each update's start: a stop during the one update (the
    default) let the step finish and publish a version after it, past the 30 s torchrun
    waits before it kills; a single process stopped before its next micro-batch."""
    mp.start_processes(
        _stopping_rank,
        args=(2, free_port(), str(tiny_model), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    for rank in (0, 1):
        result = json.loads((tmp_path / f"stopped{rank}.json").read_text())
        assert result == {"version": 0, "published": []}, (rank, result)


def _locked_out_rank(rank: int, world: int, port: int, state_dir: str, out: str) -> None:
    """One rank of `olp learner` (deploy.learner_runner.run) on a state dir whose learner
    lock another process holds."""
    from deploy.config import OlpConfig
    from deploy.learner_runner import LearnerAlreadyRunning, run

    _torchrun_env(rank, world, port)
    try:
        run(OlpConfig(state_dir=Path(state_dir)))
        result = "ran"
    except LearnerAlreadyRunning as exc:
        result = str(exc)
    except Exception as exc:  # reported by the test, not lost in the spawned process
        result = f"{type(exc).__name__}: {exc}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out, f"rank{rank}.txt").write_text(result)


def test_every_rank_of_a_second_learner_stops_at_the_lock(tmp_path: Path) -> None:
    """Rank 0 alone took the learner lock: refused, it stopped while the other ranks went on
    to load the model (onto the GPUs the running learner uses) and waited at the first
    collective until torchrun killed them."""
    from deploy.state_lock import StateDirLock

    held = StateDirLock(tmp_path / "state", "learner")
    held.acquire()
    try:
        mp.start_processes(
            _locked_out_rank,
            args=(2, free_port(), str(tmp_path / "state"), str(tmp_path)),
            nprocs=2,
            start_method="spawn",
        )
    finally:
        held.release()
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.startswith("another learner is running on state dir"), (rank, said)
        assert f"(pid {os.getpid()})" in said
    assert oct(held.path.stat().st_mode & 0o777) == "0o600"
