"""`olp demo`: simulated IDE/agent users that show the proxy learning from its traffic.

Several sessions send a verifiable task ("What is A plus B? Reply with only the number.")
through the proxy with the real `openai` client, grade each sampled reply the way an IDE
plug-in grades an edit (a verifier), post the grade as feedback, and keep going while the
learner trains, the gate decides and versions swap. At the end: a summary table per
serving version and a PNG plot of the rolling reward with version boundaries and gate
verdicts.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import structlog
from openai.types.chat import ChatCompletion

from proxy.operator_chart import rolling_mean

log = structlog.get_logger(__name__)

PROMPT = "What is {a} plus {b}? Reply with only the number."
INTEGER_ONLY = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")
LEADING_INTEGER = re.compile(r"^\s*(-?\d+)")


def grade(
    text: str, finish_reason: str | None, completion_tokens: int, max_tokens: int, expected: int
) -> float:
    """Shaped verifier reward in [0, 1.5]: a bare number > a leading number > anything else.

    A reply cut off at the token limit never counts as a number (a run of digits to the
    limit was the first reward hack seen here), and shorter replies earn a little more.
    """
    brevity = 0.2 * (1.0 - min(completion_tokens, max_tokens) / max_tokens)
    if finish_reason != "stop":
        return 0.0
    bare = INTEGER_ONLY.match(text)
    if bare:
        return 1.0 + brevity + (0.3 if int(bare.group(1)) == expected else 0.0)
    lead = LEADING_INTEGER.match(text)
    if lead:
        return 0.5 + brevity
    return brevity * 0.5


@dataclass
class Sample:
    at: float
    session: str
    version: str
    reward: float
    bare_number: bool


@dataclass
class DemoLog:
    samples: list[Sample] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    feedback_posted: int = 0
    feedback_failed: int = 0
    stopped_because: str | None = None  # set when the sessions gave up on the proxy
    reserved: int = 0  # answered requests and those in flight (`reserve`)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, samples: list[Sample]) -> None:
        with self.lock:
            self.samples.extend(samples)
            self.requests += 1

    def reserve(self, limit: int | None) -> bool:
        """Take one of `limit` answered requests before sending, False once all are taken
        (answered or in flight): checked after each answer, every session's request then in
        flight went past `--requests`. A request that fails gives its slot back."""
        with self.lock:
            if limit is not None and self.reserved >= limit:
                return False
            self.reserved += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.reserved -= 1


@dataclass
class DemoSettings:
    proxy_url: str
    api_key: str
    sessions: int = 4
    samples_per_request: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    duration_s: float = 1800.0
    max_requests: int | None = None
    seed: int = 0
    out_dir: Path = Path(".olp/demo")
    # A session failing this many times in a row (requests or feedback posts) means the
    # proxy is gone or broken: the demo stops with that reason instead of spinning on.
    max_consecutive_failures: int = 10


def _session_loop(
    settings: DemoSettings, name: str, demo: DemoLog, stop: threading.Event, rng: random.Random
) -> None:
    # The stack's own proxy: never through $http_proxy, which would get the tenant key.
    client = openai.OpenAI(
        base_url=f"{settings.proxy_url}/v1",
        api_key=settings.api_key,
        timeout=300,
        max_retries=0,
        http_client=httpx.Client(trust_env=False, timeout=300),
    )
    feedback = httpx.Client(
        base_url=settings.proxy_url,
        timeout=30,
        headers={"Authorization": f"Bearer {settings.api_key}"},
        trust_env=False,
    )
    failures = 0  # in a row, this session's

    def failed(what: str, error: str) -> None:
        nonlocal failures
        failures += 1
        log.warning(what, session=name, error=error)
        if failures >= settings.max_consecutive_failures:
            with demo.lock:
                if demo.stopped_because is None:
                    demo.stopped_because = (
                        f"{name} failed {failures} times in a row (last: {error}); "
                        f"is the proxy at {settings.proxy_url} still up?"
                    )
            stop.set()

    try:
        while not stop.is_set():
            if not demo.reserve(settings.max_requests):
                stop.set()  # `--requests` sent (counted when sent, so sessions never overshoot)
                break
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="policy",
                    messages=[{"role": "user", "content": PROMPT.format(a=a, b=b)}],
                    n=settings.samples_per_request,
                    max_tokens=settings.max_tokens,
                    temperature=settings.temperature,
                    extra_headers={"X-Session-Id": name, "X-OLP-Task": "arith-plus"},
                )
                completion = raw.parse()
                if (
                    not isinstance(completion, ChatCompletion)
                    or not completion.choices
                    or any(choice.message is None for choice in completion.choices)
                ):
                    # A proxy (or something on its port) answering 200 with another body.
                    raise ValueError(f"not a chat completion: {str(completion)[:200]!r}")
            except (openai.OpenAIError, ValueError) as exc:
                demo.release()
                with demo.lock:
                    demo.errors += 1
                failed("demo_request_failed", str(exc))
                stop.wait(2.0)
                continue
            version = raw.headers.get("x-olp-policy-version", "?")
            trajectory_id = raw.headers.get("x-olp-trajectory-id")
            samples = []
            clean = True  # the request and all its feedback posts went through
            for choice in completion.choices:
                text = choice.message.content or ""
                # The proxy strips the token ids it asked for itself: with one choice the
                # usage counts them (words stood in for tokens before).
                usage = completion.usage
                tokens = (
                    usage.completion_tokens
                    if usage is not None and len(completion.choices) == 1
                    else len(getattr(choice, "token_ids", None) or []) or len(text.split())
                )
                reward = grade(text, choice.finish_reason, tokens, settings.max_tokens, a + b)
                # A run of digits the token limit cut off is graded 0 (a reward hack), not a
                # bare number: counted as one, the column read 100 % beside a mean of 0.
                bare = choice.finish_reason == "stop" and bool(INTEGER_ONLY.match(text))
                samples.append(Sample(time.time(), name, version, reward, bare))
                if trajectory_id and not stop.is_set():
                    error = _post_feedback(feedback, trajectory_id, choice.index, reward)
                    with demo.lock:
                        if error is None:
                            demo.feedback_posted += 1
                        else:
                            demo.feedback_failed += 1
                    if error is not None:
                        clean = False
                        failed("demo_feedback_failed", error)
            if clean:
                failures = 0
            demo.add(samples)
    finally:
        client.close()
        feedback.close()


def _post_feedback(
    feedback: httpx.Client, trajectory_id: str, choice_index: int, reward: float
) -> str | None:
    """None once the proxy accepted the grade, else why not (one line, for the log)."""
    try:
        resp = feedback.post(
            "/v1/feedback",
            json={
                "trajectory_id": trajectory_id,
                "kind": "score",
                "value": reward,
                "choice_index": choice_index,
                "metadata": {"grader": "arith-verifier"},
            },
        )
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if resp.status_code != 202:
        return f"feedback refused ({resp.status_code}): {resp.text[:200]}"
    return None


def summarise(demo: DemoLog) -> list[dict[str, Any]]:
    """Per serving version, in order of first appearance."""
    rows: dict[str, dict[str, Any]] = {}
    for sample in demo.samples:
        row = rows.setdefault(
            sample.version, {"version": sample.version, "samples": 0, "rewards": [], "bare": 0}
        )
        row["samples"] += 1
        row["rewards"].append(sample.reward)
        row["bare"] += sample.bare_number
    return [
        {
            "version": r["version"],
            "samples": r["samples"],
            "mean_reward": round(statistics.fmean(r["rewards"]), 3),
            "bare_number_rate": round(r["bare"] / r["samples"], 3),
        }
        for r in rows.values()
    ]


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'version':<14}{'samples':>9}{'mean reward':>13}{'bare number':>13}"]
    for row in rows:
        lines.append(
            f"{row['version']:<14}{row['samples']:>9}{row['mean_reward']:>13.3f}"
            f"{row['bare_number_rate']:>12.0%}"
        )
    return "\n".join(lines)


def gate_events(audit_path: Path, since: float) -> list[dict[str, Any]]:
    """Gate verdicts and promotions from the audit log, newer than `since`."""
    if not audit_path.exists():
        return []
    from safety.audit import AuditError, iter_records

    events = []
    try:
        for record in iter_records(audit_path):
            if record.get("event") not in ("gate_result", "promotion", "rollback"):
                continue
            ts = record.get("ts")
            at = _parse_ts(ts)
            if at is not None and at >= since:
                events.append({**record, "at": at})
    except (AuditError, OSError) as exc:
        # The run's own figures must not go with it: raised here, no table, summary or plot
        # was written after a whole demo.
        log.warning("demo_audit_unreadable", path=str(audit_path), error=str(exc))
    return events


def _parse_ts(ts: Any) -> float | None:
    from datetime import datetime

    if isinstance(ts, int | float):
        return float(ts)
    if isinstance(ts, str):
        try:
            return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def plot(demo: DemoLog, events: list[dict[str, Any]], out: Path, window: int = 64) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = sorted(demo.samples, key=lambda s: s.at)
    rewards = [s.reward for s in samples]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(range(len(rewards)), rolling_mean(rewards, window), label=f"rolling reward ({window})")
    previous = None
    for i, sample in enumerate(samples):
        if sample.version != previous:
            ax.axvline(i, color="grey", linestyle="--", linewidth=0.8)
            ax.text(i, ax.get_ylim()[1] * 0.98, sample.version, rotation=90, va="top", fontsize=7)
            previous = sample.version
    times = [s.at for s in samples]
    for event in events:
        if event.get("event") != "gate_result" or not times:
            continue
        index = next((i for i, t in enumerate(times) if t >= event["at"]), len(times) - 1)
        passed = event.get("payload", {}).get("passed")
        ax.scatter(
            [index],
            [0.02],
            marker="^" if passed else "x",
            color="green" if passed else "red",
            zorder=3,
        )
    ax.set_xlabel("samples served (8 per request)")
    ax.set_ylabel("verifier reward")
    ax.set_title("olp demo: reward vs traffic (▲ gate passed, × gate rejected)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_demo(settings: DemoSettings, audit_path: Path | None = None) -> dict[str, Any]:
    demo = DemoLog()
    stop = threading.Event()
    started = time.time()
    threads = [
        threading.Thread(
            target=_session_loop,
            args=(settings, f"demo-session-{i}", demo, stop, random.Random(settings.seed + i)),
            daemon=True,
        )
        for i in range(settings.sessions)
    ]
    for thread in threads:
        thread.start()
    try:
        while any(t.is_alive() for t in threads):
            if time.time() - started >= settings.duration_s:
                stop.set()
            _progress(demo, started)
            time.sleep(5)
    except KeyboardInterrupt:
        stop.set()
    if any(t.is_alive() for t in threads):
        print("waiting for the requests in flight (Ctrl-C again: summarise without them)")
        try:
            for thread in threads:
                thread.join(timeout=600)
        except KeyboardInterrupt:
            # A second Ctrl-C raised through the command as a traceback, and the run's
            # summary and plot were never written: they are, from what was answered.
            print("not waiting: summarising what was answered")
    rows = summarise(demo)
    events = gate_events(audit_path, started) if audit_path else []
    png = plot(demo, events, settings.out_dir / "reward.png")
    summary = {
        "requests": demo.requests,
        "errors": demo.errors,
        "feedback_posted": demo.feedback_posted,
        "feedback_failed": demo.feedback_failed,
        "stopped_because": demo.stopped_because,
        "minutes": round((time.time() - started) / 60, 1),
        "versions": rows,
        "gate_results": [
            {"version": e["payload"].get("version"), "passed": e["payload"].get("passed")}
            for e in events
            if e.get("event") == "gate_result"
        ],
        "plot": str(png),
    }
    (settings.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n" + format_table(rows))
    print(
        f"requests {demo.requests}, errors {demo.errors}, feedback posted "
        f"{demo.feedback_posted}, feedback failed {demo.feedback_failed}, "
        f"minutes {summary['minutes']}, plot {png}"
    )
    if demo.stopped_because:
        print(f"olp demo: stopped early: {demo.stopped_because}", file=sys.stderr)
    return summary


def _progress(demo: DemoLog, started: float) -> None:
    with demo.lock:
        recent = demo.samples[-64:]
        requests = demo.requests
    if not recent:
        return
    mean = statistics.fmean(s.reward for s in recent)
    print(
        f"\rdemo: {time.time() - started:6.0f} s  requests {requests:5d}  "
        f"recent reward {mean:5.2f}  serving {recent[-1].version:<12}",
        end="",
        file=sys.stderr,
        flush=True,
    )
