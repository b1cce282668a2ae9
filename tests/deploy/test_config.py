import json
from pathlib import Path

import pytest

from deploy.config import DEFAULT_CONFIG_FILE, ConfigError, load_config, load_config_file


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "olp.yaml"
    path.write_text(text)
    return path


def test_default_config_runs_the_embedded_stack_without_edits() -> None:
    cfg = load_config(None, environ={})
    assert cfg.proxy.host == "127.0.0.1"
    assert cfg.policy.host == "127.0.0.1"
    assert cfg.stream.bootstrap_servers.startswith("127.0.0.1:")
    assert [t.name for t in cfg.tenants] == ["demo"]
    assert cfg.tenants[0].training_enabled is False  # training is off until enabled
    assert "api_key:" not in DEFAULT_CONFIG_FILE.read_text()  # only hashes are stored


def test_unknown_keys_are_named(tmp_path: Path) -> None:
    path = write(tmp_path, "proxy:\n  prot: 9000\nbogus_section: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    message = str(err.value)
    assert "proxy.prot: unknown key" in message
    assert "bogus_section: unknown key" in message


def test_invalid_values_are_named(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "policy:\n  port: 70000\n  dtype: int8\nproxy:\n  upstreams: [ftp://x]\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    message = str(err.value)
    assert "policy.port" in message
    assert "policy.dtype" in message
    assert "proxy.upstreams" in message


def test_a_number_given_true_or_false_is_refused_not_read_as_one(tmp_path: Path) -> None:
    """pydantic's lax mode read `max_tokens: true` as 1 and `temperature: false` as 0."""
    text = (
        "safety:\n  gates:\n    sampling:\n      max_tokens: true\n      temperature: false\n"
        "tenants:\n  - name: t\n    api_key: key-of-tenant-t\n    requests_per_minute: true\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), environ={})
    assert str(err.value).splitlines()[1:] == [
        "  safety.gates.sampling.max_tokens: a number is due, not a true/false value",
        "  safety.gates.sampling.temperature: a number is due, not a true/false value",
        "  tenants.0.requests_per_minute: a number is due, not a true/false value",
    ]
    env = {"OLP_SAFETY__GATES": "{sampling: {max_tokens: true}}"}
    with pytest.raises(ConfigError, match=r"safety\.gates\.sampling\.max_tokens: a number"):
        load_config(None, environ=env)
    # Booleans stay booleans, and a number from the environment is still read from its text.
    cfg = load_config(None, environ={"OLP_SAFETY__GATES__SAMPLING__MAX_TOKENS": "7"})
    assert cfg.safety.gates.sampling.max_tokens == 7


@pytest.mark.parametrize(("value", "got"), [(".inf", "inf"), (".nan", "nan"), ("-.inf", "-inf")])
def test_an_infinite_or_nan_setting_is_refused(tmp_path: Path, value: str, got: str) -> None:
    """`drain_s: .inf` was taken: a stop then waited for ever on a request that never ended,
    and a NaN timeout compared false with everything. Every section refuses both."""
    text = f"proxy:\n  drain_s: {value}\nlearner:\n  promotion:\n    drain_s: {value}\n"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), environ={})
    assert str(err.value).splitlines()[1:] == [
        f"  proxy.drain_s: Input should be a finite number (got {got})",
        f"  learner.promotion.drain_s: Input should be a finite number (got {got})",
    ]
    with pytest.raises(ConfigError, match=r"stream\.sink_batch_wait_s"):
        load_config(None, environ={"OLP_STREAM__SINK_BATCH_WAIT_S": "inf"})


def test_an_importance_cap_below_one_is_refused(tmp_path: Path) -> None:
    """min(ρ, C) with C < 1 scaled down on-policy tokens too (and with PPO zeroed the
    gradient of negative advantages at ρ = 1); 1 itself is a valid truncation."""
    with pytest.raises(ConfigError, match=r"learner\.importance_cap"):
        load_config(write(tmp_path, "learner:\n  importance_cap: 0.5\n"), environ={})
    assert load_config(write(tmp_path, "learner:\n  importance_cap: 1\n"), environ={})


def test_env_overrides_apply_and_are_validated(tmp_path: Path) -> None:
    cfg = load_config(None, environ={"OLP_PROXY__PORT": "9001", "OLP_STATE_DIR": str(tmp_path)})
    assert cfg.proxy.port == 9001
    assert cfg.state_dir == tmp_path
    with pytest.raises(ConfigError, match=r"proxy\.port"):
        load_config(None, environ={"OLP_PROXY__PORT": "not-a-port"})
    # Unrelated OLP_* variables are not config keys.
    assert load_config(None, environ={"OLP_CACHE_DIR": "/x"}).proxy.port == 8000


def test_plaintext_keys_are_hashed_at_load(tmp_path: Path) -> None:
    path = write(tmp_path, "tenants:\n  - name: acme\n    api_key: s3cret-key\n")
    cfg = load_config(path, environ={})
    assert cfg.tenants[0].api_key_sha256 is not None
    assert "s3cret-key" not in cfg.model_dump_json()


def test_duplicate_tenants_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "tenants:\n  - name: a\n  - name: a\n")
    with pytest.raises(ConfigError, match="duplicate tenant names: a"):
        load_config(path, environ={})


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "proxy: [\n"), environ={})


def test_errors_never_echo_secrets(tmp_path: Path) -> None:
    path = write(tmp_path, "proxy:\n  admin_key: ''\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "admin_key must be a non-empty string" in str(err.value)
    assert "(got" not in str(err.value)  # the section's input is never echoed
    path = write(tmp_path, "policy:\n  api_key: [vllm-SUPERSECRET]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert "policy.api_key" in str(err.value) and "SUPERSECRET" not in str(err.value)


def test_errors_about_a_section_or_the_whole_file_never_echo_its_keys(tmp_path: Path) -> None:
    """A model validator's input is the section or the whole file: the shared-key and
    duplicate-name errors printed every plaintext key in it."""
    shared = write(
        tmp_path,
        "proxy:\n  admin_key: admin-SUPERSECRET\n"
        "tenants:\n  - name: acme\n    api_key: admin-SUPERSECRET\n",
    )
    duplicate = tmp_path / "duplicate.yaml"
    duplicate.write_text(
        "tenants:\n  - name: acme\n    api_key: sk-one-SUPERSECRET\n"
        "  - name: acme\n    api_key: sk-two-SUPERSECRET\n"
    )
    environ = {"OLP_POLICY__API_KEY": "vllm-SUPERSECRET"}
    for path, message in ((shared, "one API key is used by tenant acme"), (duplicate, "acme")):
        with pytest.raises(ConfigError) as err:
            load_config(path, environ=environ)
        assert message in str(err.value)
        assert "SUPERSECRET" not in str(err.value)


@pytest.mark.parametrize("name", [".", ".."])
def test_a_tenant_name_that_no_url_can_address_is_refused(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, f"tenants:\n  - name: '{name}'\n    api_key: k-{len(name)}\n")
    with pytest.raises(ConfigError, match="names no URL path segment"):
        load_config(path, environ={})


def test_configured_keys_lose_surrounding_whitespace_as_presented_keys_do(tmp_path: Path) -> None:
    """A YAML block scalar's newline or a pasted blank validated, was hashed with the key and
    never matched: a presented key (`Bearer <key>`) is stripped, as `olp key hash` strips."""
    from proxy.config import sha256_hex

    path = write(
        tmp_path,
        'proxy:\n  admin_key: " admin-secret"\n'
        "tenants:\n  - name: acme\n    api_key: |\n      sk-acme-123\n",
    )
    cfg = load_config(path, environ={})
    assert cfg.proxy.admin_key_sha256 == sha256_hex("admin-secret")
    assert cfg.tenants[0].api_key_sha256 == sha256_hex("sk-acme-123")
    with pytest.raises(ConfigError, match="api_key must be a non-empty string"):
        load_config(write(tmp_path, "tenants:\n  - name: acme\n    api_key: '  '\n"), environ={})


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_policy_key_is_refused_not_taken_as_no_key(key: str, tmp_path: Path) -> None:
    """An unset variable in an env file gives an empty key, which started vLLM with no key
    (its LoRA load/unload open to any local process) instead of a per-run random one."""
    with pytest.raises(ConfigError, match=r"policy\.api_key: OLP_POLICY__API_KEY is set but"):
        load_config(None, environ={"OLP_POLICY__API_KEY": key})
    with pytest.raises(ConfigError, match=r"policy\.api_key: .*non-empty"):
        load_config(write(tmp_path, f"policy:\n  api_key: '{key}'\n"), environ={})


def test_env_admin_key_replaces_the_files_hash() -> None:
    from proxy.config import sha256_hex

    cfg = load_config(None, environ={"OLP_PROXY__ADMIN_KEY": "prod-admin"})
    assert cfg.proxy.admin_key_sha256 == sha256_hex("prod-admin")


def test_env_mapping_keys_keep_their_case() -> None:
    cfg = load_config(None, environ={"OLP_POLICY__ENV__VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert cfg.policy.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def test_malformed_yaml_env_value_names_the_key_not_the_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, environ={"OLP_PROXY__ADMIN_KEY": "{s3cr3t-admin-key"})
    message = str(err.value)
    assert "proxy.admin_key" in message
    assert "OLP_PROXY__ADMIN_KEY" in message
    assert "s3cr3t" not in message


def test_env_ipv6_addresses_are_strings_not_yaml_lists() -> None:
    cfg = load_config(None, environ={"OLP_STREAM__BOOTSTRAP_SERVERS": "[::1]:9092"})
    assert cfg.stream.bootstrap_servers == "[::1]:9092"
    two = load_config(None, environ={"OLP_STREAM__BOOTSTRAP_SERVERS": "[::1]:9092,[::1]:9093"})
    assert two.stream.bootstrap_servers == "[::1]:9092,[::1]:9093"
    # A bare bracketed address too, as the file takes it (it was refused as bad YAML).
    hosts = load_config(None, environ={"OLP_PROXY__HOST": "[::1]", "OLP_POLICY__HOST": "[::1]"})
    assert hosts.proxy.host == "::1" and hosts.policy.host == "::1"
    link = load_config(None, environ={"OLP_PROXY__HOST": "[fe80::1]"})  # YAML: a list
    assert link.proxy.host == "fe80::1"
    zoned = load_config(None, environ={"OLP_PROXY__HOST": "[fe80::1%eth0]"})
    assert zoned.proxy.host == "fe80::1%eth0"
    allowed = load_config(None, environ={"OLP_PROXY__ALLOWED_HOSTS": "[fe80::1]"})
    assert allowed.proxy.allowed_hosts == ["fe80::1"]  # a list key keeps its one-item list
    # Lists still are lists, numbers in them too (no colon inside the brackets).
    listed = load_config(None, environ={"OLP_POLICY__EXTERNAL_URLS": "[http://a:1]"})
    assert listed.policy.external_urls == ["http://a:1"]
    listed = load_config(None, environ={"OLP_POLICY__EXTRA_ARGS": "[--enforce-eager]"})
    assert listed.policy.extra_args == ["--enforce-eager"]  # a list is still YAML


def test_yaml_file_errors_give_the_position_not_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "proxy:\n  admin_key: s3cr3t-admin-key: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    message = str(err.value)
    assert "not valid YAML" in message
    assert "line 2, column" in message
    assert "s3cr3t" not in message


def test_env_scalars_are_taken_verbatim_as_the_docs_say() -> None:
    from deploy.config_docs import render
    from proxy.config import sha256_hex

    cfg = load_config(
        None, environ={"OLP_PROXY__ADMIN_KEY": '"quoted"', "OLP_LEARNER__ENABLED": "off"}
    )
    assert cfg.proxy.admin_key_sha256 == sha256_hex('"quoted"')  # the quotes are kept
    assert cfg.learner.enabled is False
    docs = render()
    assert "do not quote it (quotes would become part of the" in docs
    assert "so quote" not in docs


@pytest.mark.parametrize("servers", ["kafka-0:9092,kafka-1:9092", "[::1]:9092", "k:1, j:2"])
def test_bootstrap_servers_accept_host_port_lists(tmp_path: Path, servers: str) -> None:
    cfg = load_config(write(tmp_path, f"stream: {{bootstrap_servers: '{servers}'}}\n"), {})
    assert cfg.stream.bootstrap_servers == servers


@pytest.mark.parametrize("servers", ["nohostport", "host:", "a:1,b", " , "])
def test_bootstrap_servers_must_be_host_port(servers: str) -> None:
    with pytest.raises(ConfigError, match=r"stream\.bootstrap_servers: .*expected HOST:PORT"):
        load_config(None, environ={"OLP_STREAM__BOOTSTRAP_SERVERS": servers})


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (
            "tenants:\n  - {name: a, api_key: k-1}\n  - {name: b, api_key: k-1}\n",
            "one API key is used by tenant a and tenant b",
        ),
        (
            "proxy: {admin_key: k-2}\ntenants:\n  - {name: a, api_key: k-2}\n",
            "one API key is used by tenant a and the admin key",
        ),
    ],
)
def test_a_key_shared_by_two_holders_is_refused(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    """The proxy finds a tenant by its key's hash: the second tenant silently became the
    first, and a tenant holding the admin key could flip aliases."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, yaml_text), environ={})


def test_the_judges_key_is_not_shown_by_config_show() -> None:
    cfg = load_config(
        None, environ={"OLP_LEARNER__REWARDS__JUDGE__API_KEY": "sk-judge-SUPERSECRET"}
    )
    assert cfg.learner.rewards.judge.api_key.get_secret_value() == "sk-judge-SUPERSECRET"
    assert "SUPERSECRET" not in json.dumps(cfg.model_dump(mode="json"))


_URL_PASSWORD = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    "url",
    [
        f"http://user:{_URL_PASSWORD}@vllm-0:8000",
        f"https://user:{_URL_PASSWORD}@vllm-0.internal:8000/v1",
        f"http://:{_URL_PASSWORD}@10.0.0.5:8000",
        f"http://{_URL_PASSWORD}@vllm-0:8000",  # a token as the user name
        f"http://user:{_URL_PASSWORD}@[::1]:8000",
        f"http://user:pa/{_URL_PASSWORD}@vllm-0:8000",  # an unescaped '/' in the password
        f"http://user:pa@{_URL_PASSWORD}@vllm-0:8000",  # an unescaped '@' in the password
        f"ftp://user:{_URL_PASSWORD}@vllm-0:8000",  # the scheme message echoed it too
        f"user:{_URL_PASSWORD}@vllm-0:8000",
    ],
)
def test_policy_urls_with_credentials_are_refused_without_echoing_them(
    tmp_path: Path, url: str
) -> None:
    """`policy.external_urls: [http://user:pass@host]` validated, and `olp config show` (its
    name holds none of key/secret/token/password) printed the password."""
    from_file = write(tmp_path, f"policy:\n  external_urls: ['http://vllm-1:8000', '{url}']\n")
    from_env = {"OLP_POLICY__EXTERNAL_URLS": f"['{url}']"}
    for path, environ in ((from_file, {}), (None, from_env)):
        with pytest.raises(ConfigError) as err:
            load_config(path, environ=environ)
        message = str(err.value)
        assert "policy.external_urls:" in message and "policy.api_key" in message, message
        assert _URL_PASSWORD not in message, message
        assert "vllm-0" in message or "10.0.0.5" in message or "::1" in message, message


def test_judge_and_classifier_urls_with_credentials_are_refused_without_echoing_them(
    tmp_path: Path,
) -> None:
    """Both base URLs took `user:password@`, and `olp config show` printed the password."""
    for yaml_text, key in (
        (
            "learner:\n  rewards:\n    judge:\n      base_url: https://u:Judge-Pa55@judge.example\n",
            "learner.rewards.judge.base_url",
        ),
        (
            "safety:\n  gates:\n    safety_probes:\n      classifier:\n        kind: openai\n"
            "        model: guard\n        base_url: https://g:Judge-Pa55@guard.example\n",
            "safety.gates.safety_probes.classifier.base_url",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, yaml_text), environ={})
        assert key in str(err.value) and "Judge-Pa55" not in str(err.value), str(err.value)


def test_errors_hide_values_under_names_of_secrets_in_any_form(tmp_path: Path) -> None:
    """Only key/secret/token/password hid a value: `policy.env.DB_PASSWD` and
    `*_CREDENTIALS` values were echoed in the error."""
    path = write(
        tmp_path, "policy:\n  env:\n    DB_PASSWD: 987654321\n    OPENAI_CREDENTIALS: 1234567890\n"
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    message = str(err.value)
    assert "policy.env.DB_PASSWD" in message and "policy.env.OPENAI_CREDENTIALS" in message
    assert "987654321" not in message and "1234567890" not in message, message


def test_plain_policy_urls_still_validate() -> None:
    urls = "[http://vllm-0:8000/, https://10.0.0.5:8000/v1, 'http://[::1]:8000']"
    cfg = load_config(None, environ={"OLP_POLICY__EXTERNAL_URLS": urls})
    assert cfg.policy.external_urls == [
        "http://vllm-0:8000",
        "https://10.0.0.5:8000",
        "http://[::1]:8000",
    ]


def test_config_show_masks_secret_looking_vllm_env_values_and_arguments() -> None:
    """`policy.env` (where HF_TOKEN goes) and `policy.extra_args` (`--auth-token X`) were
    printed verbatim by `olp config show`; the SecretStr fields were masked."""
    from deploy.config import shown_config

    environ = {
        "OLP_POLICY__ENV": (
            "{HF_TOKEN: sekrit1, VLLM_LOGGING_LEVEL: INFO,"
            " HF_ENDPOINT: 'https://me:sekrit5@mirror.example/hf',"
            " OPENAI_APIKEY: sekrit7, DB_PASSPHRASE: sekrit8, MY_CREDS: sekrit10}"
        ),
        "OLP_POLICY__EXTRA_ARGS": (
            "[--auth-token, sekrit2, --hf-token=sekrit3, --tokenizer, tok/dir,"
            " --download-url=https://me:sekrit6@mirror.example, --apikey, sekrit9]"
        ),
        "OLP_POLICY__API_KEY": "sekrit4",
    }
    shown = shown_config(load_config(None, environ=environ))
    assert "sekrit" not in json.dumps(shown)
    assert shown["policy"]["env"] == {
        "HF_TOKEN": "**********",
        "VLLM_LOGGING_LEVEL": "INFO",
        "HF_ENDPOINT": "https://**********@mirror.example/hf",  # a URL's user info too
        "OPENAI_APIKEY": "**********",  # words ending as a secret's name
        "DB_PASSPHRASE": "**********",
        "MY_CREDS": "**********",  # shown in clear before
    }
    assert shown["policy"]["extra_args"] == [
        "--auth-token",
        "**********",
        "--hf-token=**********",
        "--tokenizer",
        "tok/dir",
        "--download-url=https://**********@mirror.example",
        "--apikey",
        "**********",
    ]


def test_a_stack_needs_a_fixed_proxy_port_and_a_state_dir_may_start_at_home() -> None:
    with pytest.raises(ConfigError, match=r"proxy\.port 0 would pick a free port"):
        load_config(None, environ={"OLP_PROXY__PORT": "0"})
    # `~/olp` made a directory named `~` below the working directory.
    cfg = load_config(None, environ={"OLP_STATE_DIR": "~/olp-state"})
    assert cfg.state_dir == Path.home() / "olp-state"
    # `olp learner` trained on policy.model whatever learner.base_model_dir said.
    with pytest.raises(ConfigError, match=r"learner\.base_model_dir is for a Learner embedded"):
        load_config(None, environ={"OLP_LEARNER__BASE_MODEL_DIR": "/models/other"})
    # `~` alone is YAML's null: pydantic's "not a valid path (got None)" did not say so.
    with pytest.raises(ConfigError, match=r"state_dir: is null \(`~` alone is YAML's null\)"):
        load_config(None, environ={"OLP_STATE_DIR": "~"})


def test_an_env_digest_replaces_the_files_plaintext_admin_key(tmp_path: Path) -> None:
    """Environment values win: an env digest beside a file's plaintext admin_key was a
    "two different keys" error."""
    from proxy.config import sha256_hex

    path = write(tmp_path, "proxy:\n  admin_key: file-key-123\n")
    digest = sha256_hex("env-key-456")
    cfg = load_config(path, environ={"OLP_PROXY__ADMIN_KEY_SHA256": digest})
    assert cfg.proxy.admin_key_sha256 == digest


def test_a_key_given_twice_in_the_file_is_refused_naming_it(tmp_path: Path) -> None:
    """A second `proxy:` section appended to the file replaced the first in silence: its
    admin key went with it, and the admin API was off."""
    path = write(
        tmp_path,
        "proxy:\n  admin_key: first-admin-key\ntenants: []\nproxy:\n  port: 9000\n",
    )
    with pytest.raises(ConfigError, match=r"'proxy' is given twice .*lines 1 and 4") as err:
        load_config(path, environ={})
    assert "first-admin-key" not in str(err.value)
    nested = write(tmp_path, "tenants:\n  - name: a\n    api_key: k1\n    name: b\n")
    with pytest.raises(ConfigError, match=r"'name' is given twice"):
        load_config(nested, environ={})


def test_yaml_merge_keys_are_read_and_a_key_beside_one_overrides_it(tmp_path: Path) -> None:
    """`<<: *shared` was refused as "not valid YAML" (the duplicate-key check constructed
    the merge key itself)."""
    path = write(
        tmp_path,
        "tenants:\n"
        "  - &a {name: a, api_key: key-of-a, training_enabled: true, requests_per_minute: 60}\n"
        "  - {<<: *a, name: b, api_key: key-of-b, requests_per_minute: 5}\n",
    )
    tenants = {t.name: t for t in load_config(path, environ={}).tenants}
    assert tenants["a"].training_enabled and tenants["b"].training_enabled
    assert (tenants["a"].requests_per_minute, tenants["b"].requests_per_minute) == (60, 5)


def test_a_list_as_a_mapping_key_is_a_config_error(tmp_path: Path) -> None:
    """A TypeError traceback (unhashable list) before."""
    path = write(tmp_path, "proxy:\n  ? [x]\n  : 1\n")
    with pytest.raises(ConfigError, match="a mapping key must be a plain value, not a list"):
        load_config(path, environ={})


def test_a_variable_below_a_key_set_by_another_variable(tmp_path: Path) -> None:
    """Merged in the environment's order: the key's mapping replaced the key below it in
    silence when it came later, and a scalar that came first made a TypeError."""
    both = {"OLP_SAFETY__GATES__KL__CAP": "0.3", "OLP_SAFETY__GATES__KL": "{max_prompts: 8}"}
    for environ in (both, dict(reversed(both.items()))):
        kl = load_config(None, environ).safety.gates.kl
        assert (kl.cap, kl.max_prompts) == (0.3, 8)
    clash = {"OLP_POLICY__ENV__HF_TOKEN": "x", "OLP_POLICY__ENV": "null"}
    with pytest.raises(ConfigError, match="OLP_POLICY__ENV__HF_TOKEN sets a key below "):
        load_config(None, clash)


@pytest.mark.parametrize(
    "name",
    [
        "OLP_PROXY__HOST",
        "OLP_PROXY__PORT",
        "OLP_STREAM__TOPIC_PREFIX",
        # Ignored before (the file's state dir used), or a directory named by a space.
        "OLP_STATE_DIR",
        "OLP_LOG_LEVEL",
        "OLP_LOG_FORMAT",
    ],
)
def test_an_empty_section_variable_is_refused_naming_it(name: str) -> None:
    """`OLP_PROXY__HOST=${UNSET}` made the proxy listen on every interface with its Host
    check off, and nothing said so."""
    with pytest.raises(ConfigError, match=rf"{name} is set but empty"):
        load_config(None, environ={name: ""})


def test_an_empty_host_or_upstream_key_is_refused(tmp_path: Path) -> None:
    for text, where in (
        ("proxy:\n  host: ''\n", r"proxy\.host"),
        ("policy:\n  host: ''\n", r"policy\.host"),
        ("proxy:\n  upstream_api_key: ' '\n", r"proxy\.upstream_api_key: .*non-empty"),
    ):
        with pytest.raises(ConfigError, match=where):
            load_config(write(tmp_path, text), environ={})


def test_ports_olp_up_listens_on_must_differ() -> None:
    """A clash surfaced only after vLLM had started, as "already in use (proxy.port)"."""
    with pytest.raises(ConfigError, match=r"proxy\.port and policy\.port share port 8100"):
        load_config(None, environ={"OLP_PROXY__PORT": "8100", "OLP_POLICY__PORT": "8100"})
    with pytest.raises(ConfigError, match=r"policy\.port and stream\.bootstrap_servers"):
        load_config(None, environ={"OLP_POLICY__PORT": "9092"})
    external = {"OLP_POLICY__PORT": "8000", "OLP_POLICY__EXTERNAL_URLS": "[http://vllm:8000]"}
    assert load_config(None, environ=external).proxy.port == 8000  # vLLM is elsewhere
    remote = {"OLP_PROXY__PORT": "9092", "OLP_STREAM__BOOTSTRAP_SERVERS": "kafka:9092"}
    assert load_config(None, environ=remote).proxy.port == 9092


@pytest.mark.parametrize(
    "args",
    [
        "[--host, 0.0.0.0]",
        "[--port=9000]",
        "[--dtype, half]",
        # vLLM's parser reads `_` as `-` and takes an unambiguous prefix: these set the host,
        # the port and the rank all the same, while olp said "loopback" and waited on 8100.
        "[--hos, 0.0.0.0]",
        "[--por, '9999']",
        "[--max_lora_rank, '64']",
        "[--api-key, k]",  # in argv, read by any local user, and won over olp's key
    ],
)
def test_extra_args_may_not_set_what_a_policy_key_sets(args: str) -> None:
    """Appended last, `--host`/`--port` won: vLLM listened elsewhere than olp checked,
    warned about and waited on."""
    with pytest.raises(ConfigError, match=r"policy\.extra_args: .* is set from policy\."):
        load_config(None, environ={"OLP_POLICY__EXTRA_ARGS": args})
    assert load_config(None, environ={"OLP_POLICY__EXTRA_ARGS": "[--enforce-eager]"})


def test_extra_args_may_not_name_a_file_of_vllm_flags() -> None:
    """vLLM reads flags from it past olp's checks: `api-key` in it was taken."""
    for args in ("[--config, flags.yaml]", "[--config=flags.yaml]"):
        with pytest.raises(ConfigError, match=r"policy\.extra_args: --config: vLLM would read"):
            load_config(None, environ={"OLP_POLICY__EXTRA_ARGS": args})


def test_the_learners_rank_must_fit_the_launched_vllm() -> None:
    """vLLM refused every adapter the learner had trained and gated, at load."""
    too_big = {"OLP_LEARNER__LORA_RANK": "32"}
    with pytest.raises(ConfigError, match=r"learner\.lora_rank 32 is above policy\.max_lora"):
        load_config(None, environ=too_big)
    assert load_config(None, environ={**too_big, "OLP_POLICY__MAX_LORA_RANK": "32"})
    external = {**too_big, "OLP_POLICY__EXTERNAL_URLS": "[http://vllm:8000]"}
    assert load_config(None, environ=external)  # its rank is the external server's own
    with pytest.raises(ConfigError, match=r"policy\.max_lora_rank: .*vLLM takes one of 1, 8"):
        load_config(None, environ={"OLP_POLICY__MAX_LORA_RANK": "24"})


def test_a_bracketed_ipv6_policy_host_is_bound_without_its_brackets(tmp_path: Path) -> None:
    """vLLM bound `[::1]` as a name and died at start-up."""
    path = write(tmp_path, "policy:\n  host: '[::1]'\ntenants: []\n")
    assert load_config(path, environ={}).policy.host == "::1"
    empty = write(tmp_path, "policy:\n  host: '[]'\ntenants: []\n")  # vLLM: every interface
    with pytest.raises(ConfigError, match=r"policy\.host: .*an address is needed"):
        load_config(empty, environ={})


@pytest.mark.parametrize("section", ["policy", "proxy"])
@pytest.mark.parametrize("host", [" ", "127.0.0.1 ", "[ ]"])
def test_a_bind_address_with_spaces_is_refused(tmp_path: Path, section: str, host: str) -> None:
    """Accepted, then `getaddrinfo` failed on it and the process died at start-up."""
    path = write(tmp_path, f"{section}:\n  host: '{host}'\ntenants: []\n")
    with pytest.raises(ConfigError, match=rf"{section}\.host: .*(address is needed|no spaces)"):
        load_config(path, environ={})


def test_a_bracketed_ipv6_proxy_host_is_bound_without_its_brackets(tmp_path: Path) -> None:
    path = write(tmp_path, "proxy:\n  host: '[::1]'\ntenants: []\n")
    assert load_config(path, environ={}).proxy.host == "::1"


def test_a_variable_below_a_key_a_yaml_mapping_variable_set_to_a_scalar() -> None:
    """A KeyError traceback: the scalar came from the mapping of another variable."""
    environ = {"OLP_SAFETY__GATES": "{kl: 0.5}", "OLP_SAFETY__GATES__KL__CAP": "0.3"}
    with pytest.raises(ConfigError, match="which OLP_SAFETY__GATES sets to a value that is not"):
        load_config(None, environ)


def test_an_empty_actor_or_admin_key_option_is_refused() -> None:
    """Both fell back: the change was audited under the login name, or sent with
    OLP_ADMIN_KEY or the dev key."""
    from deploy.admin_client import AdminError, admin_key, operator_name

    with pytest.raises(AdminError, match="--actor is empty"):
        operator_name("  ")
    with pytest.raises(AdminError, match="--admin-key is empty"):
        admin_key(load_config(None, environ={}), "")


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("OLP_TENANTS__0__TRAINING_ENABLED", "tenants"),
        ("OLP_ON_CHILD_EXIT", "on_child_exit"),
        ("OLP_MAX_RESTARTS", "max_restarts"),
    ],
)
def test_a_variable_for_a_key_set_in_the_file_only_is_refused_naming_it(
    name: str, key: str
) -> None:
    """`OLP_ON_CHILD_EXIT=restart` was ignored in silence; `OLP_TENANTS__*` gave "tenants:
    Input should be a valid list", naming neither the variable nor the rule."""
    with pytest.raises(ConfigError, match=rf"{key}: {name} is not read: .* config file only"):
        load_config(None, environ={name: "true"})


@pytest.mark.parametrize(
    ("name", "key", "meant"),
    [
        ("OLP_PROXY_PORT", "proxy.port", "OLP_PROXY__PORT"),
        ("OLP_PROXY_ADMIN_KEY", "proxy.admin_key", "OLP_PROXY__ADMIN_KEY"),
        ("OLP_Learner_LR", "learner.lr", "OLP_LEARNER__LR"),
        ("OLP_SAFETY_GATES_KL_CAP", "safety.gates.kl.cap", "OLP_SAFETY__GATES__KL__CAP"),
        (
            "OLP_PROXY_STATE_RECORDS_DIR",
            "proxy.state.records_dir",
            "OLP_PROXY__STATE__RECORDS_DIR",
        ),
        # Below `env` a name keeps its case, as OLP_POLICY__ENV__* keeps it.
        ("OLP_POLICY_ENV_http_proxy", "policy.env.http_proxy", "OLP_POLICY__ENV__http_proxy"),
    ],
)
def test_a_section_variable_with_one_underscore_is_refused_naming_the_right_one(
    name: str, key: str, meant: str
) -> None:
    """`OLP_PROXY_ADMIN_KEY` was ignored in silence: the proxy started without the admin
    key its operator meant to set."""
    with pytest.raises(ConfigError, match=rf"{key}: {name} is not read: .*\({meant}\)"):
        load_config(None, environ={name: "9000"})


@pytest.mark.parametrize("name", ["OLP_SAFETY_GATES__KL__CAP", "OLP_SAFETY_GATES_KL__CAP"])
def test_a_variable_naming_no_section_is_refused_naming_the_one_meant(name: str) -> None:
    """`OLP_SAFETY_GATES__KL__CAP` left the cap as the file set it, in silence."""
    refused = rf"{name} is not read: .*\(.*did you mean OLP_SAFETY__GATES__KL__CAP\?\)"
    with pytest.raises(ConfigError, match=refused):
        load_config(None, environ={name: "0.1"})
    with pytest.raises(ConfigError, match=r"no section `foo` .*sections: proxy, policy"):
        load_config(None, environ={"OLP_FOO__BAR": "1"})


@pytest.mark.parametrize(
    ("name", "how"),
    [
        ("OLP_PROXY", "OLP_PROXY__<KEY>"),
        ("OLP_SAFETY", "OLP_SAFETY__<KEY>"),
        ("OLP_TENANTS", "file"),
    ],
)
def test_a_whole_section_in_one_variable_is_refused(name: str, how: str) -> None:
    """`OLP_PROXY='{port: 9001}'` was ignored in silence: the proxy kept port 8000."""
    with pytest.raises(ConfigError, match=rf"{name} is not read: a whole section .*{how}"):
        load_config(None, environ={name: "{port: 9001}"})


def test_the_stacks_other_variables_are_not_taken_for_config_typos() -> None:
    """OLP_STREAM_ID, OLP_CACHE_DIR and the like share the prefix and are not config keys."""
    environ = {
        "OLP_STREAM_ID": "run-2",
        "OLP_CACHE_DIR": "/tmp/cache",
        "OLP_ADMIN_KEY": "k" * 32,
        "OLP_PROXY__PORT": "9100",
        # The start of a key is no key: nothing to name as the one meant.
        "OLP_PROXY_ADMIN": "x",
        "OLP_STREAM_SINK": "x",
    }
    assert load_config(None, environ=environ).proxy.port == 9100


@pytest.mark.parametrize("path", ["", ".", "audit/", "audit/..", "audit/."])
def test_an_audit_path_naming_no_file_is_refused_naming_the_key(tmp_path: Path, path: str) -> None:
    """`""` named the state dir itself: start-up failed with "Is a directory", naming no key."""
    config = write(tmp_path, f"safety:\n  audit:\n    path: {path!r}\n")
    with pytest.raises(ConfigError, match=r"safety\.audit\.path.*must name a file"):
        load_config(config, environ={})


def test_a_url_without_a_scheme_holding_a_password_is_not_echoed(tmp_path: Path) -> None:
    """Only a value with both `://` and `@` was hidden: a URL refused for its missing scheme
    was shown with its password."""
    text = (
        "safety:\n  gates:\n    safety_probes:\n      classifier:\n"
        '        base_url: "u:Sekret99@guard-host:8000"\n'
    )
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), environ={})
    assert "Sekret99" not in str(err.value) and "classifier.base_url" in str(err.value)


@pytest.mark.parametrize(("cap", "refused"), [("1.0", True), ("1.2", True), ("1.21", False)])
def test_ppo_needs_an_importance_cap_above_its_clip_range(cap: str, refused: bool) -> None:
    """PPO's dual clip at C·A: with C inside the clip range a negative-advantage token above
    ρ = C had no gradient (at C = 1, about half the on-policy ones)."""
    environ = {"OLP_LEARNER__PPO_CLIP_EPS": "0.2", "OLP_LEARNER__IMPORTANCE_CAP": cap}
    if refused:
        with pytest.raises(ConfigError, match=r"importance_cap .* must be above 1 \+ ppo_clip"):
            load_config(None, environ=environ)
    else:
        assert load_config(None, environ=environ).learner.importance_cap == 1.21
    assert load_config(None, environ={"OLP_LEARNER__IMPORTANCE_CAP": "1.0"})  # no PPO: fine


def test_olp_up_pins_the_config_it_parsed_even_from_a_pipe(tmp_path: Path, monkeypatch) -> None:
    """`olp up --config <(envsubst < olp.tmpl.yaml)`: the pipe was read to its end by the
    load, read again for the children's copy (empty: the defaults) and every such start
    was refused as "changed while olp up started". The copy is the bytes parsed; a file
    edited after the load is not what this run's children read either."""
    import os
    import threading

    from deploy.supervisor import Stack

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    text = DEFAULT_CONFIG_FILE.read_bytes().replace(b"demo", b"piped", 1)
    assert text != DEFAULT_CONFIG_FILE.read_bytes()
    read, write = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write, text), os.close(write)))
    writer.start()
    try:
        piped = Path(f"/dev/fd/{read}")
        cfg, parsed = load_config_file(piped)
    finally:
        writer.join()
        os.close(read)
    assert parsed == text
    stack = Stack(cfg, piped, config_bytes=parsed)
    stack.pin_config()
    assert stack.child_config is not None and stack.child_config.read_bytes() == text
    assert load_config(stack.child_config).hash() == cfg.hash()
    edited = tmp_path / "olp.yaml"
    edited.write_bytes(text)
    loaded, parsed = load_config_file(edited)
    edited.write_bytes(text + b"\n# edited after the load\n")
    stack = Stack(loaded, edited, config_bytes=parsed)
    stack.pin_config()
    assert stack.child_config is not None and stack.child_config.read_bytes() == text
