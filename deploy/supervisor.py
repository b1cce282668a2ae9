"""`olp up`: run broker, policy, proxy and learner as children of one foreground process.

One instance per state dir (a lock file says who holds it); Ctrl-C, SIGTERM or SIGHUP stops
every child by PID, in reverse start order, also during start-up; a child that dies is
reported with its last output and, per `on_child_exit`, restarted or the whole stack stops.
A child that cannot be helped by a restart (a configuration error, a refused state dir, the
same failure right after the last restart) is not restarted: the stack stops instead. The
embedded broker is never restarted; with `on_child_exit: restart` the stack keeps serving
without it (the proxy spills what it records).
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from pydantic import SecretStr

from deploy.broker import kafka_answers, start_broker
from deploy.config import ConfigError, OlpConfig, load_config
from deploy.dev_keys import DEV_ADMIN_KEY, DEV_API_KEY, exposed_dev_keys
from deploy.direct_http import open_direct
from deploy.learner_runner import STREAM_ID_ENV
from deploy.policy import PolicyServer, check_external, start_policy
from deploy.ports import is_loopback, local_http_url, port_open, split_host_port
from deploy.procs import (
    EXIT_CONFIG_ERROR,
    EXIT_REFUSED,
    ChildProcess,
    StopRequested,
    install_stop_handlers,
    say,
    wait_until,
)
from deploy.runtime import resolve_model_dir
from deploy.state_lock import LockHeld, StateDirLock
from proxy.config import INTERNAL_ADMIN_TOKEN_ENV, sha256_hex
from proxy.serving_state import load_state, switch_applies
from safety.audit import AuditLog
from safety.redaction import Redactor

log = structlog.get_logger(__name__)

POLICY_KEY_ENV = "OLP_POLICY__API_KEY"  # the environment override of policy.api_key


# The embedded broker is not restarted: its data lived in memory, so a new one would be a new,
# empty stream under the running learner. With on_child_exit: restart the stack keeps
# serving without it (the proxy's sink spills what it records, nothing is lost, and the next
# `olp up` sends the spill to its new broker); why it died is the operator's to see first.
RESTARTABLE = ("policy", "proxy", "learner")
BROKER_DOWN = (
    "olp: not restarting broker: its data was in memory, a new one would be an empty stream; "
    "the proxy keeps serving and spills trajectories and feedback to disk (the learner gets "
    "nothing new): run olp up again to start a new broker, which is sent the spill"
)
# A restarted child that fails again this soon after its start, with the same exit code,
# fails the same way each time: restarting it further only delays the operator's fix.
CRASH_LOOP_S = 30.0
# Added to the stream worker's own bound when a child's group outlives the child (below).
GROUP_GRACE_MARGIN_S = 5.0


class AlreadyRunning(RuntimeError):
    pass


class StackLock:
    """<state_dir>/run/up.lock: a second `olp up` says so instead of orphaning."""

    def __init__(self, state_dir: Path) -> None:
        self._lock = StateDirLock(state_dir, "up")

    def acquire(self) -> None:
        try:
            self._lock.acquire()
        except LockHeld as held:
            raise AlreadyRunning(
                f"olp up is already running for state dir {self._lock.path.parent.parent} "
                f"(pid {held.holder}); stop it first (Ctrl-C in its terminal, or kill "
                f"{held.holder})"
            ) from None

    def release(self) -> None:
        self._lock.release()


@dataclass
class Component:
    name: str
    start: Callable[[], ChildProcess]
    describe: str
    child: ChildProcess | None = None
    restarts: int = 0
    stopper: Callable[[], None] | None = field(default=None)
    started_at: float = field(default_factory=time.monotonic)
    last_code: int | None = None  # the exit code of the previous run, once restarted
    down: bool = False  # died, was reported and is not restarted; the others go on


def _http_ok(url: str) -> bool:
    try:
        with open_direct(url, 2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class Stack:
    def __init__(
        self,
        cfg: OlpConfig,
        config_path: Path | None,
        *,
        with_learner: bool = True,
        config_bytes: bytes | None = None,
    ):
        self.cfg = cfg
        self.config_path = config_path
        self.config_bytes = config_bytes  # what was parsed from config_path
        # What the children read: the file as this run loaded it (`pin_config`).
        self.child_config: Path | None = config_path
        self.with_learner = with_learner and cfg.learner.enabled
        self.state_dir = cfg.state_dir.resolve()
        self.logs_dir = self.state_dir / "logs"
        self.components: list[Component] = []
        self._stop = threading.Event()
        self.lock = StackLock(self.state_dir)
        self._internal_token = secrets.token_urlsafe(32)
        # The vLLM this run starts takes a key of its own unless the config names one: on
        # loopback it is still reachable by every local process and, through DNS rebinding,
        # by web pages, and its runtime LoRA loading would be theirs to use.
        self._policy_key: str | None = None
        if not cfg.policy.external_urls and cfg.policy.api_key is None:
            self._policy_key = secrets.token_urlsafe(32)
        self._stream_id: str | None = None  # set when this run starts the embedded broker
        # A child that died (a crash, the OOM killer) may leave its stream worker behind in
        # its process group, sending or spilling what it holds: within close_timeout_s for
        # the broker, as long again to close the producer, then the disk. Its group gets
        # that long after SIGTERM before SIGKILL, so accepted records are not lost.
        self.group_grace_s = 2 * cfg.stream.close_timeout_s + GROUP_GRACE_MARGIN_S

    # ----------------------------------------------------------------- start
    def _check_stop(self) -> None:
        """Between start-up steps that do not poll (model preparation, port checks)."""
        if self._stop.is_set():
            raise StopRequested("stop requested during start-up")

    def pin_config(self) -> None:
        """Copy the config file into the run directory for the children to read.

        Given the operator's file, a proxy or learner restarted after a crash read it as
        edited since (for the next start), and the stack ran on two configs: a restarted
        proxy wrote to a new `stream.topic_prefix` while the learner read the old one. The
        copy is checked against what this run loaded (an edit in between: refused). Only
        the file: the children inherit this process's environment, which cannot change.
        The bytes this run parsed are what is copied, when given (`load_config_file`)."""
        if self.config_path is None:
            return
        pinned = self.state_dir / "run" / "config.yaml"
        pinned.parent.mkdir(parents=True, exist_ok=True)
        staged = pinned.with_name(".config.yaml.tmp")
        # Owner-only: the file may hold keys in plain text.
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            source = self.config_bytes
            out.write(source if source is not None else self.config_path.read_bytes())
        os.replace(staged, pinned)
        if load_config(pinned).hash() != self.cfg.hash():
            raise ConfigError(
                f"the config file {self.config_path} changed while olp up started; start again"
            )
        self.child_config = pinned

    def _olp_child(self, name: str, *args: str) -> ChildProcess:
        argv = [sys.executable, "-m", "deploy.cli", name, *args]
        if self.child_config is not None:
            argv += ["--config", str(self.child_config)]
        env = dict(os.environ)
        env["OLP_STATE_DIR"] = str(self.state_dir)
        # Lets the learner flip the proxy's alias without the operator's admin key; it
        # lives only in this run's process environment.
        env[INTERNAL_ADMIN_TOKEN_ENV] = self._internal_token
        if self._policy_key is not None:
            env[POLICY_KEY_ENV] = self._policy_key  # read as policy.api_key
        if name in ("learner", "proxy") and self._stream_id is not None:
            # The learner's offsets count in this run's stream; the proxy's operator page
            # measures the learner's lag in it.
            env[STREAM_ID_ENV] = self._stream_id
        return ChildProcess(
            name,
            argv,
            env=env,
            log_file=self.logs_dir / f"{name}.log",
            stop_grace_s=self._stop_timeout_s(name),
            group_grace_s=self.group_grace_s,
        )

    def start(self, progress: Callable[[str], None]) -> float:
        """Start every component in order; StopRequested once a stop signal arrives.

        The caller holds the lock (`self.lock.acquire()`) and calls `stop()` afterwards
        whatever this raises."""
        started = time.monotonic()
        cfg = self.cfg
        self.pin_config()
        self._audit_startup()
        if self.with_learner:
            self._check_learner_config()
        model_dir: Path | None = None
        if not cfg.policy.external_urls or self.with_learner:
            # Before anything starts: a bad policy.model is a config error to report now,
            # not a learner that dies after the stack is up (it trains on the same base,
            # also with an external vLLM).
            model_dir = resolve_model_dir(cfg.policy, progress)
            self._check_stop()
        host, port = split_host_port(cfg.stream.bootstrap_servers.split(",")[0])
        if is_loopback(host):
            if port_open(host, port):
                raise RuntimeError(
                    f"port {port} is already in use: stream.bootstrap_servers points at "
                    f"{host}:{port} for the embedded broker; stop what listens there or change it"
                )
            progress(f"starting embedded broker on {host}:{port}")
            broker = start_broker(host, port, self.logs_dir / "broker.log", stop=self._stop)
            # Its data lives in memory: this start's stream is a new one for the learner.
            self._stream_id = f"embedded-{uuid.uuid4().hex[:12]}"
            self.components.append(
                Component(
                    "broker",
                    lambda: broker.child,
                    f"{broker.bootstrap} (embedded)",
                    child=broker.child,
                )
            )
        elif not kafka_answers(cfg.stream.bootstrap_servers, timeout_s=10):
            raise RuntimeError(f"Kafka at {cfg.stream.bootstrap_servers} does not answer")

        if cfg.policy.external_urls:
            check_external(cfg.policy.external_urls, cfg.policy.api_key_value())
            progress(f"using external vLLM {', '.join(cfg.policy.external_urls)}")
        else:
            if port_open(cfg.policy.host, cfg.policy.port):
                raise RuntimeError(
                    f"port {cfg.policy.port} is already in use (policy.port); "
                    "stop what listens there or change it"
                )
            assert model_dir is not None
            progress(f"starting vLLM policy server on {cfg.policy.host}:{cfg.policy.port}")
            policy_cfg = cfg.policy
            if self._policy_key is not None:
                policy_cfg = policy_cfg.model_copy(update={"api_key": SecretStr(self._policy_key)})
            policy = start_policy(
                policy_cfg,
                model_dir,
                self.logs_dir / "policy.log",
                progress=lambda s: progress(f"  vLLM still starting ({s:.0f} s)"),
                stop=self._stop,
            )
            policy_log = self.logs_dir / "policy.log"
            self.components.append(
                Component(
                    "policy",
                    # A restart does not wait for readiness: meanwhile the proxy answers 502
                    # and /readyz 503, and the learner loads the serving adapter again once
                    # the new vLLM lists its models (learner/reload.py).
                    lambda: PolicyServer(policy_cfg, model_dir, policy_log).child,
                    f"{policy.base_url} (vLLM"
                    + (", loopback)" if is_loopback(cfg.policy.host) else ", NOT loopback)"),
                    child=policy.child,
                )
            )

        self._check_stop()
        proxy_url = local_http_url(cfg.proxy.host, cfg.proxy.port)
        if port_open(cfg.proxy.host, cfg.proxy.port):
            raise RuntimeError(f"port {cfg.proxy.port} is already in use (proxy.port)")
        progress(f"starting proxy on {proxy_url}")
        self._add_olp_component("proxy", f"{proxy_url}/v1")
        wait_until(
            lambda: _http_ok(f"{proxy_url}/readyz"),
            timeout_s=60,
            child=self.components[-1].child,
            what="proxy",
            stop=self._stop,
        )
        if self.with_learner:
            progress("starting learner")
            self._add_olp_component("learner", "consuming trajectories")
        return time.monotonic() - started

    def _check_learner_config(self) -> None:
        """What only the learner child reads and pydantic cannot check: the verifiers'
        import paths and the gates' probe files. Checked here so a typo stops `olp up`
        before anything starts."""
        from learner.rewards.verifiers import load_verifier
        from safety.gates.preflight import check_probe_sets
        from safety.gates.types import GateError

        try:
            check_probe_sets(self.cfg.safety.gates)
        except GateError as exc:
            raise ConfigError(f"safety.gates: {exc}") from None

        # The child runs `python -m deploy.cli`, which puts the working directory first on
        # sys.path; an `olp` console script does not: look where the child will look.
        cwd = os.getcwd()
        added = cwd not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            for spec in self.cfg.learner.rewards.verifiers:
                try:
                    load_verifier(spec.path)
                except ValueError as exc:
                    raise ConfigError(f"learner.rewards.verifiers: {exc}") from None
        finally:
            if added:
                sys.path.remove(cwd)

    def _audit_startup(self) -> None:
        redactor = Redactor.from_config(self.cfg.safety.redaction)
        audit = AuditLog.from_config(self.cfg.safety.audit, self.state_dir, redactor)
        audit.append(
            "olp-up",
            "startup",
            {"config_hash": self.cfg.hash(), "config_file": str(self.config_path or "default")},
        )

    def _add_olp_component(self, name: str, describe: str) -> None:
        comp = Component(name, lambda: self._olp_child(name), describe)
        comp.child = comp.start()
        self.components.append(comp)

    # --------------------------------------------------------------- monitor
    @property
    def stop_requested(self) -> threading.Event:
        return self._stop

    def watch(self, poll_s: float = 1.0) -> int:
        """Block until asked to stop (0; 1 when the embedded broker died meanwhile) or a
        child died and may not be restarted (1)."""
        while not self._stop.wait(poll_s):
            for comp in self.components:
                if comp.down or comp.child is None or comp.child.alive():
                    continue
                code = comp.child.poll()
                say(
                    f"olp: {comp.name} (pid {comp.child.pid}) exited with code {code}; "
                    f"last output:\n{comp.child.tail(20)}"
                )
                log.error("child_exited", child=comp.name, pid=comp.child.pid, returncode=code)
                if self.cfg.on_child_exit == "restart" and comp.name == "broker":
                    say(BROKER_DOWN)
                    log.error("child_not_restarted", child=comp.name, reason="embedded broker")
                    comp.down = True
                    # What it left in its process group goes now: by the final stop, days
                    # later maybe, its pid may lead another process group, which that stop
                    # then sent SIGTERM and SIGKILL.
                    comp.child.stop(timeout_s=5, group_grace_s=self.group_grace_s)
                    comp.child = None
                    continue
                if self.cfg.on_child_exit == "restart" and comp.name in RESTARTABLE:
                    reason = self._no_restart(comp, code, time.monotonic() - comp.started_at)
                    if reason is None:
                        # What the dead child left in its process group (vLLM's engine core,
                        # holding the model and its KV cache; the proxy's stream worker,
                        # spilling what it holds) goes before a new one starts: SIGTERM,
                        # group_grace_s to finish, then SIGKILL.
                        comp.child.stop(timeout_s=5, group_grace_s=self.group_grace_s)
                        if self._stop.is_set():
                            # Asked to stop while that group drained (up to group_grace_s):
                            # no new child (one was started, and stopped again at once). A
                            # child died and was not started again: 1, as the docs say (it
                            # was 0, as for a plain stop).
                            return 1
                        comp.restarts += 1
                        comp.last_code = code
                        say(
                            f"olp: restarting {comp.name} ({comp.restarts}/{self.cfg.max_restarts})"
                        )
                        comp.child = comp.start()
                        comp.started_at = time.monotonic()
                        continue
                    say(f"olp: not restarting {comp.name}: {reason}; stopping the stack")
                    log.error("child_not_restarted", child=comp.name, reason=reason)
                return 1
        return 1 if any(comp.down for comp in self.components) else 0

    def _no_restart(self, comp: Component, code: int | None, ran_s: float) -> str | None:
        """Why a dead child is not restarted (on_child_exit: restart), or None."""
        if code == EXIT_CONFIG_ERROR:
            return (
                f"exit code {code} is a configuration error, which a restart cannot fix; "
                "fix it (see the output above) and run olp up again"
            )
        if code == EXIT_REFUSED:
            return (
                f"exit code {code}: it refuses its state dir (see the output above), "
                "which a restart cannot change"
            )
        if comp.restarts and code == comp.last_code and ran_s < CRASH_LOOP_S:
            return (
                f"it failed the same way (exit code {code}) {ran_s:.0f} s after its "
                "restart; restarting it again will not help"
            )
        if comp.restarts >= self.cfg.max_restarts:
            return f"it was restarted {comp.restarts} times already (max_restarts)"
        return None

    def _stop_timeout_s(self, name: str) -> float:
        """How long a child may take to stop: the proxy drains its requests
        (`proxy.drain_s`), then closes its sink (`stream.close_timeout_s`); killed before,
        it lost what was in flight and in the sink's memory."""
        if name != "proxy":
            return 30.0
        return max(30.0, self.cfg.proxy.drain_s + self.cfg.stream.close_timeout_s + 10.0)

    def stop(self) -> list[str]:
        """Stop every child, newest first; one failing stop does not spare the others.

        Returns what could not be stopped ("learner (pid 123)"), each already reported."""
        failed: list[str] = []
        for comp in reversed(self.components):
            if comp.child is None:
                continue
            what = f"{comp.name} (pid {comp.child.pid})"
            try:
                comp.child.stop(
                    timeout_s=self._stop_timeout_s(comp.name), group_grace_s=self.group_grace_s
                )
            except Exception as exc:  # e.g. EPERM from kill: report it, stop the others
                log.error("child_stop_failed", child=comp.name, pid=comp.child.pid, error=str(exc))
                say(f"olp: stopping {what} failed: {exc}")
                failed.append(what)
                continue
            if comp.child.stuck:
                failed.append(what)
        self.components.clear()
        self.lock.release()
        return failed

    def _training_switches(self) -> dict[str, dict[str, bool | None]]:
        """The run-time training switches the proxy applied (it dropped stale ones at its
        start), so that the banner does not call a tenant off that the switch trains on."""
        path = self.state_dir / self.cfg.proxy.state.serving_state
        try:
            return load_state(path, {}).tenant_training
        except (OSError, ValueError) as exc:  # the proxy refused it already, with the reason
            log.warning("serving_state_unreadable", path=str(path), error=str(exc))
            return {}

    def banner(self, seconds: float) -> str:
        cfg = self.cfg
        lines = [f"olp is up in {seconds:.0f} s (state dir {self.state_dir})"]
        for comp in self.components:
            pid = comp.child.pid if comp.child else "-"
            lines.append(f"  {comp.name:<8} {comp.describe:<48} pid {pid}")
        # Reachable from this machine: `0.0.0.0` is no address a client can call, nor one the
        # proxy's Host check serves once proxy.allowed_hosts is set (400 host_not_allowed).
        proxy_url = local_http_url(cfg.proxy.host, cfg.proxy.port)
        lines += [
            f"  OpenAI base URL  {proxy_url}/v1   (model '{cfg.proxy.policy_alias}')",
            f"  metrics          {proxy_url}/metrics",
            f"  operator page    {proxy_url}/admin/ui   (sign-in link: olp ui)",
            f"  logs             {self.logs_dir}",
        ]
        switches = self._training_switches()
        for tenant in cfg.tenants:
            if tenant.api_key_sha256 == sha256_hex(DEV_API_KEY):
                lines.append(f"  API key of tenant '{tenant.name}' (dev default): {DEV_API_KEY}")
            state = "on" if tenant.training_enabled else "off"
            switch = switches.get(tenant.name)
            if switch is not None and switch_applies(switch, tenant.training_enabled):
                on = "on" if switch["enabled"] else "off"
                lines.append(
                    f"  online training for tenant '{tenant.name}' is {on}, switched at run "
                    f"time ({state} in the config); follow the config again with: "
                    f"olp tenant {tenant.name} --training config"
                )
                continue
            lines.append(
                f"  online training for tenant '{tenant.name}' is {state} in the config; "
                f"switch it with: olp tenant {tenant.name} --training on|off"
            )
        if cfg.proxy.admin_key_sha256 == sha256_hex(DEV_ADMIN_KEY):
            lines.append(f"  admin key (dev default): {DEV_ADMIN_KEY}")
        lines.append("  stop with Ctrl-C")
        return "\n".join(lines)


def run_up(
    cfg: OlpConfig,
    config_path: Path | None,
    *,
    with_learner: bool = True,
    config_bytes: bytes | None = None,
) -> int:
    """0 when asked to stop (also during start-up), 1 when start-up failed, a child died
    or a child could not be stopped."""
    exposed = exposed_dev_keys(cfg)
    if exposed is not None:
        say(f"olp: {exposed}")
        return 2
    stack = Stack(cfg, config_path, with_learner=with_learner, config_bytes=config_bytes)
    # Before the first child: a signal during start-up must reach our handler, not kill us.
    install_stop_handlers(stack.stop_requested)
    try:
        stack.lock.acquire()
    except AlreadyRunning as exc:
        say(f"olp: {exc}")
        return 1
    except OSError as exc:  # the state dir cannot be created or written (a typo, a mount)
        say(f"olp: cannot use the state dir {stack.state_dir}: {exc.strerror or exc}")
        return 1
    try:
        code = _start_and_watch(stack)
    finally:
        # Whatever happened above (a closed stdout/stderr pipe included), stop every child.
        say("olp: stopping")
        failed = stack.stop()
        if failed:
            say(f"olp: stopped, except {', '.join(failed)}: still running")
        else:
            say("olp: stopped")
    return 1 if failed else code


def _start_and_watch(stack: Stack) -> int:
    try:
        seconds = stack.start(lambda message: say(f"olp: {message}"))
    except StopRequested:
        say("olp: start-up interrupted")
        return 0
    except Exception as exc:
        say(f"olp: start-up failed: {exc}")
        return 1
    say(stack.banner(seconds), sys.stdout)
    return stack.watch()
