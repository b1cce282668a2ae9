"""Static checks of the compose and Kubernetes manifests against the config and the CLI.

No Docker or Kubernetes here: the manifests are parsed as YAML and cross-checked with the config
models (every OLP_* variable is a real key, every embedded config validates, ports and paths
agree) and with `deploy.cli.build_parser()` (every `olp ...` command parses).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from deploy import config_docs
from deploy.cli import build_parser
from deploy.config import SECTIONS, TOP_LEVEL_ENV, OlpConfig, load_config
from deploy.policy import KEY_GUARD
from proxy.host_check import HostCheck

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
K8S_DIR = ROOT / "deploy" / "k8s"
CONFIG_PATH = "/etc/olp/olp.yaml"
# OLP_* variables the code reads that are not config keys.
RUNTIME_ENV = {"OLP_ADMIN_KEY"}
# Plaintext keys the config models accept and hash (see config_docs.NOTES).
PLAINTEXT_ALIASES = {"proxy.admin_key"}
SUBST = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")
WORKLOADS = ("Deployment", "StatefulSet")


# ------------------------------------------------------------------ loading
def _yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    files = sorted(COMPOSE_DIR.glob("*.y*ml")) + sorted(K8S_DIR.rglob("*.y*ml"))
    assert files
    return files


@cache
def compose() -> dict[str, Any]:
    (doc,) = _yaml_docs(COMPOSE_DIR / "docker-compose.yml")
    return doc  # type: ignore[no-any-return]


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]  # type: ignore[no-any-return]


@cache
def k8s_objects(main_only: bool = False) -> list[dict[str, Any]]:
    files = sorted(K8S_DIR.glob("*.yaml")) if main_only else sorted(K8S_DIR.rglob("*.yaml"))
    return [doc for path in files for doc in _yaml_docs(path)]


def k8s(kind: str, name: str) -> dict[str, Any]:
    """The object applied by `kubectl apply -f deploy/k8s/` (variants/examples excluded)."""
    found = [o for o in k8s_objects(True) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} in deploy/k8s/*.yaml"
    return found[0]


def workloads(main_only: bool = False) -> Iterator[dict[str, Any]]:
    return (o for o in k8s_objects(main_only) if o["kind"] in WORKLOADS)


def pod(name: str) -> dict[str, Any]:
    kinds = [o for o in workloads(True) if o["metadata"]["name"] == name]
    assert len(kinds) == 1, f"expected one workload named {name}"
    return kinds[0]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def pod_labels(name: str) -> dict[str, str]:
    (workload,) = [o for o in workloads(True) if o["metadata"]["name"] == name]
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def container(name: str) -> dict[str, Any]:
    (only,) = pod(name)["containers"]
    return only  # type: ignore[no-any-return]


@cache
def config_text() -> str:
    return (COMPOSE_DIR / "olp.yaml").read_text()


@cache
def config() -> OlpConfig:
    return load_config(COMPOSE_DIR / "olp.yaml", environ={})


# ------------------------------------------------------------------ env and argv helpers
def substitute(value: Any) -> str:
    """Compose interpolation: `${X:-d}` → d, `${X:?msg}` / `${X}` → a placeholder."""

    def repl(match: re.Match[str]) -> str:
        name, op, arg = match.groups()
        return arg if op == "-" else f"placeholder-{name.lower()}"

    return SUBST.sub(repl, str(value))


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: substitute(v) for k, v in env.items()}


def k8s_env(spec: dict[str, Any]) -> dict[str, str]:
    return {
        e["name"]: str(e["value"]) if "value" in e else f"placeholder-{e['name'].lower()}"
        for e in spec.get("env", [])
    }


def env_sources() -> Iterator[tuple[str, dict[str, str]]]:
    """(where, environment) of every container in compose and Kubernetes."""
    for name, service in services().items():
        yield f"compose service {name}", compose_env(service)
    for obj in workloads():
        for spec in obj["spec"]["template"]["spec"]["containers"]:
            yield f"k8s {obj['metadata']['name']}/{spec['name']}", k8s_env(spec)


def compose_argv(service: dict[str, Any]) -> list[str]:
    def words(value: Any) -> list[str]:
        if value is None:
            return []
        return shlex.split(value) if isinstance(value, str) else [substitute(v) for v in value]

    return words(service.get("entrypoint")) + words(service.get("command"))


def k8s_argv(spec: dict[str, Any]) -> list[str]:
    return [str(v) for v in spec.get("command", []) + spec.get("args", [])]


def all_argvs() -> Iterator[tuple[str, list[str]]]:
    for name, service in services().items():
        yield f"compose service {name}", compose_argv(service)
    for obj in workloads():
        for spec in obj["spec"]["template"]["spec"]["containers"]:
            yield f"k8s {obj['metadata']['name']}/{spec['name']}", k8s_argv(spec)


def olp_args(argv: list[str]) -> list[str] | None:
    """The CLI arguments of `olp ...`, `python -m deploy.cli ...`, `torchrun ... -m deploy.cli`."""
    if argv and argv[0] == "olp":
        return argv[1:]
    for i, word in enumerate(argv[:-1]):
        if word == "-m" and argv[i + 1] == "deploy.cli":
            return argv[i + 2 :]
    return None


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, f"{url} needs an explicit host and port"
    return parts.hostname, parts.port


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_parses(path: Path) -> None:
    docs = _yaml_docs(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)
    if path.is_relative_to(K8S_DIR):
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc)
            if doc["kind"] != "Namespace":
                assert doc["metadata"].get("namespace") == "olp", doc["metadata"]["name"]


def test_embedded_configs_validate_and_agree() -> None:
    (configmap,) = [o for o in k8s_objects(True) if o["kind"] == "ConfigMap"]
    assert configmap["data"]["olp.yaml"] == config_text(), (
        "deploy/k8s/10-config.yaml must hold deploy/compose/olp.yaml verbatim"
    )
    cfg = config()  # raises ConfigError naming the bad key
    raw = yaml.safe_load(config_text())
    assert "admin_key" not in raw.get("proxy", {}) and "admin_key_sha256" not in raw["proxy"]
    assert all("api_key" not in tenant for tenant in raw.get("tenants", []))
    assert cfg.state_dir.is_absolute() and Path(cfg.policy.model).is_absolute()


def test_olp_env_vars_are_config_keys() -> None:
    documented = {key.dotted for key in config_docs.all_keys()} | PLAINTEXT_ALIASES
    deploy_source = "".join(p.read_text() for p in (ROOT / "deploy").glob("*.py"))
    seen = set()
    for where, env in env_sources():
        olp_env = {k: v for k, v in env.items() if k.startswith("OLP_")}
        for name in olp_env:
            seen.add(name)
            if name in RUNTIME_ENV:
                assert name in deploy_source, f"{where}: {name} is read nowhere in deploy/"
                continue
            path = name.removeprefix("OLP_").lower().split("__")
            dotted = TOP_LEVEL_ENV.get(name) or ".".join(path)
            assert name in TOP_LEVEL_ENV or path[0] in SECTIONS, f"{where}: {name} is ignored"
            assert dotted in documented, f"{where}: {name} names no config key ({dotted})"
        load_config(COMPOSE_DIR / "olp.yaml", environ=olp_env)  # the values validate too
    assert {"OLP_ADMIN_KEY", "OLP_PROXY__ADMIN_KEY", "OLP_PROXY__HOST"} <= seen


def test_olp_commands_are_real_subcommands() -> None:
    parser = build_parser()
    found: dict[str, set[str]] = {}
    for where, argv in all_argvs():
        args = olp_args(argv)
        if args is None:
            continue
        try:
            parsed = parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `olp {' '.join(args)}` is not a valid olp command")
        assert callable(parsed.handler)
        assert str(parsed.config) == CONFIG_PATH, f"{where}: --config {CONFIG_PATH} expected"
        found.setdefault(where.split()[0], set()).add(parsed.command)
    assert found == {"compose": {"proxy", "learner"}, "k8s": {"proxy", "learner"}}


def test_config_is_mounted_where_the_commands_read_it() -> None:
    for name in ("proxy", "learner"):
        assert f"./olp.yaml:{CONFIG_PATH}:ro" in services()[name]["volumes"]
        spec = pod(name)
        mount = next(
            m
            for m in container(name)["volumeMounts"]
            if m["mountPath"] == str(Path(CONFIG_PATH).parent)
        )
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "olp-config"


def _check_vllm_argv(argv: list[str], cfg: OlpConfig, port: int) -> None:
    assert argv[:3] == ["vllm", "serve", cfg.policy.model]
    assert int(flag(argv, "--port")) == port
    assert flag(argv, "--host") == "0.0.0.0"
    assert flag(argv, "--served-model-name") == cfg.policy.served_model_name
    assert "--enable-lora" in argv
    assert int(flag(argv, "--max-loras")) == cfg.policy.max_loras
    assert int(flag(argv, "--max-lora-rank")) == cfg.policy.max_lora_rank
    assert int(flag(argv, "--max-lora-rank")) >= cfg.learner.lora_rank
    assert int(flag(argv, "--max-model-len")) == cfg.policy.max_model_len
    # What `olp up` launches vLLM with: without the tool-call flags, every request with
    # `tools` got a 400 from the deployed vLLM.
    if cfg.policy.seed is not None:
        assert int(flag(argv, "--seed")) == cfg.policy.seed
    if cfg.policy.tool_call_parser:
        assert "--enable-auto-tool-choice" in argv
        assert flag(argv, "--tool-call-parser") == cfg.policy.tool_call_parser


def test_vllm_ports_and_flags_agree_with_the_config() -> None:
    cfg = config()
    assert cfg.policy.external_urls and not cfg.proxy.upstreams
    for url in cfg.policy.external_urls:
        host, port = url_host_port(url)
        service = services()[host]
        _check_vllm_argv(compose_argv(service), cfg, port)
        assert compose_env(service)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        svc = k8s("Service", host)
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["port"] == port
        spec = container(host)
        _check_vllm_argv(k8s_argv(spec), cfg, port)
        assert svc_port["targetPort"] == port
        assert [p["containerPort"] for p in spec["ports"]] == [port]
        assert k8s_env(spec)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_proxy_ports_agree_with_the_config() -> None:
    port = config().proxy.port
    published = [str(p).rsplit(":", 1)[1] for p in services()["proxy"]["ports"]]
    assert published == [str(port)]
    assert f"127.0.0.1:{port}" in " ".join(services()["proxy"]["healthcheck"]["test"])
    (svc_port,) = k8s("Service", "proxy")["spec"]["ports"]
    assert svc_port["targetPort"] == port
    spec = container("proxy")
    assert [p["containerPort"] for p in spec["ports"]] == [port]
    for probe in ("livenessProbe", "readinessProbe"):
        assert spec[probe]["httpGet"]["port"] == port
    # The learner reaches the proxy's admin API by its service name and the config's port.
    assert compose_env(services()["learner"])["OLP_PROXY__HOST"] == "proxy"
    assert (
        k8s_env(container("learner"))["OLP_PROXY__HOST"]
        == k8s("Service", "proxy")["metadata"]["name"]
    )


def test_kafka_agrees_with_the_stream_config() -> None:
    stream = config().stream
    host, _, port = stream.bootstrap_servers.partition(":")
    env = compose_env(services()[host])
    assert f"PLAINTEXT://{host}:{port}" == env["KAFKA_ADVERTISED_LISTENERS"]
    assert f":{port}" in env["KAFKA_LISTENERS"] and env["KAFKA_PROCESS_ROLES"]
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= stream.max_request_size_bytes
    svc = k8s("Service", host)
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    kenv = k8s_env(container(host))
    assert f":{port}" in kenv["KAFKA_LISTENERS"] and "controller" in kenv["KAFKA_PROCESS_ROLES"]
    assert int(kenv["KAFKA_MESSAGE_MAX_BYTES"]) >= stream.max_request_size_bytes
    assert stream.replication_factor <= k8s("StatefulSet", host)["spec"]["replicas"]


def test_proxy_probes_hit_healthz_and_readyz() -> None:
    check = " ".join(services()["proxy"]["healthcheck"]["test"])
    assert "/healthz" in check and "/readyz" in check
    spec = container("proxy")
    assert spec["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # By the pod's IP, an operator's `proxy.allowed_hosts` made the probes 400 (a restart
    # loop): they send a loopback Host, which the proxy always serves.
    for probe in ("livenessProbe", "readinessProbe"):
        assert spec[probe]["httpGet"]["httpHeaders"] == [{"name": "Host", "value": "localhost"}]
    check = HostCheck("0.0.0.0", ["olp.example.com"])
    assert check.allows("localhost") and not check.allows("10.244.1.17:8000")


def test_vllm_and_kafka_are_not_exposed() -> None:
    networks = compose()["networks"]
    for name in ("vllm", "kafka"):
        assert "ports" not in services()[name]
        assert all(networks[n].get("internal") for n in services()[name]["networks"])
    k8s_services = [o for o in k8s_objects() if o["kind"] == "Service"]
    assert {"vllm", "kafka"} <= {svc["metadata"]["name"] for svc in k8s_services}
    for svc in k8s_services:
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", svc["metadata"]["name"]


def _compose_mounts(service: str) -> dict[str, str]:
    """container path → 'source' or 'source:ro' of a compose service's short-syntax volumes."""
    out = {}
    for entry in services()[service]["volumes"]:
        parts = substitute(entry).split(":")
        mode = parts.pop() if parts[-1] in ("ro", "rw") else "rw"
        target = parts.pop()
        out[target] = ":".join(parts) + (":ro" if mode == "ro" else "")
    return out


def _k8s_mounts(name: str) -> dict[str, tuple[str, bool]]:
    """container path → (claim name, read-only) for PVC mounts of a workload."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod(name)["volumes"]
        if "persistentVolumeClaim" in v
    }
    return {
        m["mountPath"]: (claims[m["name"]], bool(m.get("readOnly")))
        for m in container(name)["volumeMounts"]
        if m["name"] in claims
    }


def test_state_dir_and_model_are_shared_at_the_configured_paths() -> None:
    cfg = config()
    state = str(cfg.state_dir)
    model = PurePosixPath(cfg.policy.model)
    for name, read_only in (("proxy", False), ("learner", False), ("vllm", True)):
        assert _compose_mounts(name)[state] == "olp-state" + (":ro" if read_only else "")
        assert _k8s_mounts(name)[state] == ("olp-state", read_only)
    for name in ("vllm", "learner"):
        assert any(model.is_relative_to(t) for t in _compose_mounts(name)), name
        assert any(
            model.is_relative_to(path) and claim == "olp-models"
            for path, (claim, _) in _k8s_mounts(name).items()
        ), name
    assert "olp-state" in compose()["volumes"]


def test_secrets_come_from_the_environment_not_the_files() -> None:
    for name in ("proxy", "learner"):
        raw = services()[name]["environment"]
        for key in ("OLP_ADMIN_KEY", "OLP_PROXY__ADMIN_KEY"):
            if key in raw:
                assert str(raw[key]).startswith("${OLP_ADMIN_KEY:?"), f"{name}: {key}"
    (secret,) = [o for o in k8s_objects() if o["kind"] == "Secret"]
    assert secret not in k8s_objects(True), "the example Secret must not be applied by default"
    for obj in workloads():
        for spec in obj["spec"]["template"]["spec"]["containers"]:
            for e in spec.get("env", []):
                if "KEY" in e["name"] and e["name"].startswith("OLP_"):
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] in secret["stringData"]
    lines = (COMPOSE_DIR / "Dockerfile").read_text().splitlines()
    dockerfile = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert "ADMIN_KEY" not in dockerfile and "olp.yaml" not in dockerfile  # nothing baked in
    assert 'pip install ".[gpu]"' in dockerfile


def test_vllm_and_its_callers_share_one_key_from_the_secrets() -> None:
    """vLLM listened without a key on the cluster network: any pod (or anything routed in)
    could load and unload adapters at run time."""
    vllm_env = services()["vllm"]["environment"]
    assert str(vllm_env["VLLM_API_KEY"]).startswith("${OLP_VLLM_KEY:?")
    for name in ("proxy", "learner"):
        raw = services()[name]["environment"]
        assert str(raw["OLP_POLICY__API_KEY"]).startswith("${OLP_VLLM_KEY:?"), name
    refs = {}
    for obj in workloads():
        for spec in obj["spec"]["template"]["spec"]["containers"]:
            for e in spec.get("env", []):
                if e["name"] in ("VLLM_API_KEY", "OLP_POLICY__API_KEY"):
                    refs[(obj["metadata"]["name"], e["name"])] = e["valueFrom"]["secretKeyRef"]
    wanted = {("vllm", "VLLM_API_KEY"), ("proxy", "OLP_POLICY__API_KEY")}
    assert wanted | {("learner", "OLP_POLICY__API_KEY")} <= set(refs)
    assert {ref["key"] for ref in refs.values()} == {"vllm-key"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        (container,) = pod("vllm")["containers"]
        assert container[probe]["httpGet"]["path"] == "/health"  # needs no key


def _module_path(pythonpath: str) -> PurePosixPath:
    """Where vLLM's `--middleware` import finds the key guard, given the container's path."""
    module, _, _ = KEY_GUARD.rpartition(".")
    return PurePosixPath(pythonpath, *module.split(".")).with_suffix(".py")


def test_vllm_asks_for_its_key_on_every_route_in_compose_and_kubernetes() -> None:
    """vLLM's own key check covers /v1 only: its SageMaker routes answered chats and loaded
    and unloaded adapters without the key. The image runs olp's guard as on `olp up`."""
    guard_file = ROOT / "deploy" / "vllm_key_guard.py"
    service = services()["vllm"]
    assert flag(compose_argv(service), "--middleware") == KEY_GUARD
    target = _module_path(compose_env(service)["PYTHONPATH"])
    mounts = [str(v).split(":") for v in service["volumes"]]
    (source,) = [src for src, dest, *_ in mounts if PurePosixPath(dest) == target]
    assert (COMPOSE_DIR / source).resolve() == guard_file
    spec = container("vllm")
    assert flag(k8s_argv(spec), "--middleware") == KEY_GUARD
    target = _module_path(k8s_env(spec)["PYTHONPATH"])
    (mount,) = [m for m in spec["volumeMounts"] if PurePosixPath(m["mountPath"]) == target.parent]
    (volume,) = [v for v in pod("vllm")["volumes"] if v["name"] == mount["name"]]
    assert "optional" not in volume["configMap"]  # a pod without the guard does not start
    readme = (K8S_DIR / "README.md").read_text()
    made = f"create configmap {volume['configMap']['name']} --from-file=deploy/{target.name}"
    assert made in readme  # the ConfigMap's key is the file's name


def test_the_key_guard_imports_with_the_standard_library_alone(tmp_path: Path) -> None:
    """The vLLM image has none of olp's dependencies and only this file of its tree."""
    import shutil
    import subprocess
    import sys

    target = Path(_module_path(str(tmp_path)))
    target.parent.mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "vllm_key_guard.py", target)
    module, _, cls = KEY_GUARD.rpartition(".")
    olp_deps = {"deploy.config", "pydantic", "structlog", "msgspec"}
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {module} as m; "
        f"print(m.{cls}.__name__, sorted(set(sys.modules) & {olp_deps!r}))"
    )
    # -I: no PYTHONPATH, no user site; the working directory is not this tree.
    result = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert result.stdout.strip() == f"{cls} []"


def test_only_the_proxy_and_the_learner_reach_vllm_on_kubernetes() -> None:
    """vLLM's SageMaker routes answer chats and load and unload adapters; the key guard asks
    for the key there, and besides, the Service was open to every pod of the cluster."""
    policy = k8s("NetworkPolicy", "vllm-callers")["spec"]
    vllm_labels = pod_labels("vllm")
    assert policy["podSelector"]["matchLabels"].items() <= vllm_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    callers = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert all(len(peer) == 1 for peer in rule["from"])  # pods of this namespace only
    assert callers == [{"app.kubernetes.io/name": n} for n in ("proxy", "learner")]
    for caller, name in zip(callers, ("proxy", "learner"), strict=True):
        assert caller.items() <= pod_labels(name).items()
    assert rule["ports"] == [{"port": container("vllm")["ports"][0]["containerPort"]}]


def test_only_the_proxy_and_the_learner_reach_kafka_on_kubernetes() -> None:
    """The stream has no SASL/TLS and the learner trains on what the topics hold: the broker
    was open to every pod of the cluster (read every captured prompt, write training data)."""
    policy = k8s("NetworkPolicy", "kafka-callers")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels("kafka").items()
    assert policy["policyTypes"] == ["Ingress"]
    clients, itself = policy["ingress"]
    callers = [peer["podSelector"]["matchLabels"] for peer in clients["from"]]
    assert callers == [{"app.kubernetes.io/name": n} for n in ("proxy", "learner")]
    for caller, name in zip(callers, ("proxy", "learner"), strict=True):
        assert caller.items() <= pod_labels(name).items()
    ports = [p["containerPort"] for p in container("kafka")["ports"]]
    assert clients["ports"] == [{"port": ports[0]}]
    assert [peer["podSelector"]["matchLabels"] for peer in itself["from"]] == [
        {"app.kubernetes.io/name": "kafka"}
    ]
    assert itself["ports"] == [{"port": port} for port in ports]


def test_k8s_pods_disable_service_links() -> None:
    # A Service named vllm injects VLLM_PORT=tcp://..., which vLLM refuses to start with.
    pods = list(workloads())
    assert {"vllm", "proxy", "learner"} <= {obj["metadata"]["name"] for obj in pods}
    for obj in pods:
        assert obj["spec"]["template"]["spec"].get("enableServiceLinks") is False


def test_learner_gets_gpus_and_torchrun_matches_them() -> None:
    cfg = config()
    assert services()["learner"]["deploy"]["resources"]["reservations"]["devices"]
    assert int(container("learner")["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    (variant,) = _yaml_docs(K8S_DIR / "variants" / "learner-torchrun.yaml")
    (spec,) = variant["spec"]["template"]["spec"]["containers"]
    argv = k8s_argv(spec)
    assert argv[0] == "torchrun"
    nproc = int(flag(argv, "--nproc-per-node"))
    assert nproc == int(spec["resources"]["limits"]["nvidia.com/gpu"]) > 1
    assert nproc <= cfg.stream.partitions
    assert variant["metadata"]["name"] == "learner"  # applying it replaces the default learner
