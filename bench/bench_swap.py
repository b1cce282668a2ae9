"""Hot-swap benchmark: swap latency vs the bare vLLM load call, traffic p99 during swaps,
gate suite wall time per candidate.

    ./olpw bench/bench_swap.py            (via: $(./olpw env)/bin/python bench/bench_swap.py)

Starts its own vLLM (or uses OLP_BENCH_VLLM_URL) and an `olp proxy`, writes the figures
to docs/perf/swap.md and prints them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from generated_block import write_generated  # noqa: E402
from percentile import nearest_rank  # noqa: E402

from deploy.config import PolicyConfig  # noqa: E402
from deploy.model_prep import prepare_model  # noqa: E402
from deploy.policy import start_policy  # noqa: E402
from deploy.ports import free_port  # noqa: E402
from learner.adapter_store import AdapterStore  # noqa: E402
from learner.config import PromotionConfig  # noqa: E402
from learner.promotion import Promoter, ProxyAdmin, ReplicaSet  # noqa: E402
from safety.audit import AuditLog  # noqa: E402
from safety.config import GatesConfig  # noqa: E402
from safety.gates.types import GateReport  # noqa: E402

ADMIN, TENANT = "bench-admin", "bench-key"


def pct(values: list[float], q: float) -> float:
    return nearest_rank(sorted(values), q)


def write_adapter(base_model: object, path: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(
        base_model,
        LoraConfig(
            r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj"]
        ),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.01)
    model.save_pretrained(path)
    model.unload()
    return path


def start_proxy(vllm_url: str, state: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = state / "olp.yaml"
    state.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"state_dir: {state}\nproxy: {{port: {port}, admin_key: {ADMIN}, sink: jsonl}}\n"
        f"policy: {{external_urls: ['{vllm_url}']}}\n"
        f"tenants: [{{name: bench, api_key: {TENANT}, requests_per_minute: 0, "
        "max_concurrent: 0}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "proxy", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("proxy did not start")


class Traffic:
    """Concurrent short chat requests through the proxy; latencies and failures."""

    def __init__(self, url: str, workers: int) -> None:
        self.url, self.workers = url, workers
        self.latencies: list[float] = []
        self.failures = 0
        self.stop = threading.Event()

    def _loop(self) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {TENANT}"}) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                r = c.post(
                    f"{self.url}/v1/chat/completions",
                    json={
                        "model": "policy",
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Hi"}],
                    },
                )
                if r.status_code == 200:
                    self.latencies.append(time.perf_counter() - t)
                else:
                    self.failures += 1

    def run_for(self, seconds: float, during: object = None) -> None:
        threads = [threading.Thread(target=self._loop) for _ in range(self.workers)]
        for th in threads:
            th.start()
        end = time.monotonic() + seconds
        if callable(during):
            during(end)
        while time.monotonic() < end:
            time.sleep(0.1)
        self.stop.set()
        for th in threads:
            th.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--swaps", type=int, default=8)
    parser.add_argument("--traffic-s", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "perf" / "swap.md")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = prepare_model().path
    server = None
    vllm_url = os.environ.get("OLP_BENCH_VLLM_URL")
    if not vllm_url:
        server = start_policy(PolicyConfig(port=free_port()), model_dir)
        vllm_url = server.base_url
    tmp = Path(tempfile.mkdtemp(prefix="olp-bench-swap-"))
    proxy, url = start_proxy(vllm_url, tmp / "state")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = httpx.Client(timeout=120)
    try:
        client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {TENANT}"},
            json={
                "model": "policy",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )  # warm-up

        # (1) bare load call, the floor
        bare = []
        for i in range(args.swaps):
            path = write_adapter(base, tmp / f"bare-{i}", seed=100 + i)
            name = f"bare-{uuid.uuid4().hex[:8]}"
            t = time.perf_counter()
            r = client.post(
                f"{vllm_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            )
            bare.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            client.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": name})

        # (2) olp swaps: load → gate verdict → flip → first request on the new version.
        # olp loads a candidate before gating it (the gate samples from it), so the swap the
        # issue times starts at the gate's verdict: flip, then the first request served.
        store = AdapterStore(tmp / "state")
        gate_done: list[float] = []

        def gate_passes(candidate: str, incumbent: str) -> GateReport:
            gate_done.append(time.perf_counter())
            return GateReport(passed=True, results=[], candidate=candidate, incumbent=incumbent)

        promoter = Promoter(
            PromotionConfig(drain_s=1.0),
            GatesConfig(),
            replicas=ReplicaSet([vllm_url]),
            proxy=ProxyAdmin(url, ADMIN),
            audit=AuditLog(tmp / "state" / "audit" / "audit.jsonl"),
            state_dir=tmp / "state",
            base_name="base",
            gate_runner=gate_passes,
        )
        loads, flips, first_served, first_reply = [], [], [], []
        version = 0
        # Written up front: building an adapter with torch here would load the same two
        # cores as the traffic whose p99 is being measured.
        prepared = [
            write_adapter(base, tmp / f"files-{i}", seed=i)
            for i in range(args.swaps + int(args.traffic_s / 2) + 2)
        ]

        def one_reply() -> tuple[str | None, float]:
            t = time.perf_counter()
            r = client.post(
                f"{url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {TENANT}"},
                json={
                    "model": "policy",
                    "max_tokens": 1,
                    "messages": [{"role": "user", "content": "Hi"}],
                },
            )
            return r.headers.get("x-olp-policy-version"), time.perf_counter() - t

        def one_swap() -> float:
            nonlocal version
            version += 1
            files = prepared.pop()
            vdir = store.publish(version, files, {"parent_version": version - 1})
            outcome = promoter.promote(vdir)
            flipped = time.perf_counter()
            assert outcome.decision == "promoted", outcome.reason
            while True:
                served, took = one_reply()
                if served == f"policy-v{version}":
                    break
            done = time.perf_counter()
            loads.append(outcome.timings["load_s"])
            flips.append(flipped - gate_done[-1])
            first_served.append(done - gate_done[-1])
            first_reply.append(took)
            return done - gate_done[-1]

        for _ in range(args.swaps):
            one_swap()
        steady = [one_reply()[1] for _ in range(args.swaps)]  # same request, nothing changing

        # (3) traffic p99 with and without swaps
        quiet = Traffic(url, args.workers)
        quiet.run_for(args.traffic_s)
        busy = Traffic(url, args.workers)
        swaps_during: list[float] = []

        def swapping(end: float) -> None:
            while time.monotonic() < end - 3:
                swaps_during.append(one_swap())
                time.sleep(2.0)

        busy.run_for(args.traffic_s, during=swapping)

        # (4) gate suite wall time per candidate (defaults), against the serving version
        from safety.gates.suite import run_gate_suite_sync

        gate_times = []
        for i in range(2):
            files = write_adapter(base, tmp / f"gate-{i}", seed=500 + i)
            name = f"policy-v{900 + i}"
            ReplicaSet([vllm_url]).load(name, files)
            t = time.perf_counter()
            report = run_gate_suite_sync(
                GatesConfig(),
                base_url=vllm_url,
                candidate=name,
                incumbent=f"policy-v{version}",
                base="base",
            )
            gate_times.append(time.perf_counter() - t)
            client.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": name})
            print(f"gate run {i}: passed={report.passed} {gate_times[-1]:.1f} s")
        promoter.close()
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        if server is not None:
            server.stop()

    # The table shows the swaps on a quiet server; those under traffic only feed the p99 rows.
    n = args.swaps
    loads, flips, first_served, first_reply = (
        loads[:n],
        flips[:n],
        first_served[:n],
        first_reply[:n],
    )

    def row(label: str, values: list[float]) -> str:
        med = statistics.median(values) * 1000
        return f"| {label} | {med:.1f} | {pct(values, 0.9) * 1000:.1f} | {med / med_bare:.1f}× |"

    med_bare = statistics.median(bare) * 1000
    med_flip = statistics.median(flips) * 1000
    med_served = statistics.median(first_served) * 1000
    med_reply = statistics.median(first_reply) * 1000
    med_steady = statistics.median(steady) * 1000
    q_p99, b_p99 = pct(quiet.latencies, 0.99) * 1000, pct(busy.latencies, 0.99) * 1000
    lines = [
        "## Hot swap (bench/bench_swap.py)",
        "",
        f"One run on this machine ({os.cpu_count()} cores), vLLM CPU build, SmolLM2-135M, "
        f"r8 adapters, {args.swaps} swaps; traffic: {args.workers} concurrent 4-token chat "
        f"requests through the proxy for {args.traffic_s:.0f} s each. Ratios are against the "
        "bare load call's median.",
        "",
        "| measure | median (ms) | p90 (ms) | ratio |",
        "|---|---|---|---|",
        row("bare `/v1/load_lora_adapter` call (floor)", bare),
        row("olp load + confirm in `/v1/models` (before the gate, which samples from it)", loads),
        row(
            "**swap: gate verdict → alias flipped** (gate report written, verdict audited, "
            "replicas re-checked, state fsynced, flip audited); every request from here is "
            "served by the new version",
            flips,
        ),
        row("gate verdict → first (1-token) reply from the new version received", first_served),
        row("that first reply's own round trip", first_reply),
        row("the same request with nothing changing (steady state)", steady),
        "",
        "| traffic | requests | failed | p50 (ms) | p99 (ms) |",
        "|---|---|---|---|---|",
        f"| without swaps | {len(quiet.latencies)} | {quiet.failures} | "
        f"{pct(quiet.latencies, 0.5) * 1000:.0f} | {q_p99:.0f} |",
        f"| with a swap every ~2 s ({len(swaps_during)} swaps) | {len(busy.latencies)} | "
        f"{busy.failures} | {pct(busy.latencies, 0.5) * 1000:.0f} | {b_p99:.0f} |",
        "",
        f"p99 during swaps / without: {b_p99 / q_p99:.2f}×. Gate suite (default config) wall "
        f"time per candidate: {', '.join(f'{t:.1f} s' for t in gate_times)}.",
        "",
        f"Swap (gate verdict → flipped) {med_flip:.1f} ms = {med_flip / med_bare:.1f}× the bare "
        f"load call (target ≤ 5×). Gate verdict → first reply from the new version "
        f"{med_served:.1f} ms = {med_served / med_bare:.1f}×, of which the reply's own round "
        f"trip is {med_reply:.1f} ms (steady state {med_steady:.1f} ms): the swap adds "
        f"{med_served - med_steady:.1f} ms to the first request.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    write_generated(args.out, text, "bench_swap.py")


if __name__ == "__main__":
    main()
