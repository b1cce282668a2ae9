"""Generate docs/configuration.md from the pydantic config models.

The reference is generated so it cannot drift from the code: tests/deploy/test_config_docs.py
fails when the committed file differs from `render()`. Regenerate with

    python -m deploy.config_docs > docs/configuration.md

Descriptions come from `Field(description=...)`, else from the comment that ends the field's
line in the model's source (several models document their fields only that way). Rules that a
validator enforces across fields cannot be read from the models; `NOTES` states them, and the
test checks that every model with a validator has a note.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from deploy.config import ENV_PREFIX, SECTIONS, TOP_LEVEL_ENV, OlpConfig

REGENERATE = "python -m deploy.config_docs > docs/configuration.md"
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Validator rules per model class name (a model with validators must have an entry).
NOTES: dict[str, list[str]] = {
    "OlpConfig": [
        "Tenant names must be unique, and one API key belongs to one holder: two tenants, or "
        "a tenant and the admin key, may not share a key.",
        "`proxy.port` must not be 0 here: the learner and the `olp` commands must know it.",
        "`proxy.port`, `policy.port` (when olp launches vLLM) and the embedded broker's port "
        "(`stream.bootstrap_servers` on a loopback host) must differ.",
        "`state_dir` may start with `~` (the home directory).",
        "`learner.lora_rank` must not exceed `policy.max_lora_rank` when olp launches vLLM "
        "(vLLM refuses a larger adapter at load).",
    ],
    "StreamConfig": [
        "`bootstrap_servers` must be `HOST:PORT[,HOST:PORT...]`.",
        "`compression_type` other than `gzip` needs its library installed (python-snappy, "
        "lz4, zstandard: kafka-python's codecs); without it loading the config fails.",
        "`delivery_timeout_ms` must be above `linger_ms` + `request_timeout_ms` (the Kafka "
        "producer refuses it otherwise).",
    ],
    "PolicyConfig": [
        "`external_urls` must be http(s) URLs without a user name or password (vLLM's key goes "
        "in `api_key`); a trailing `/` or `/v1` is stripped.",
        "`api_key` must not be empty: null (the default) gives the launched vLLM a random key of "
        "its own each run.",
        "`extra_args` must not hold a flag the launcher sets from a key of this section "
        "(`--host`, `--port`, `--model`, `--served-model-name`, `--max-loras`, "
        "`--max-lora-rank`, `--max-model-len`, `--dtype`, `--seed`, `--tool-call-parser`, "
        "`--api-key`), in any spelling vLLM's parser reads as one (`--max_lora_rank`, a "
        "prefix such as `--hos`); nor `--config` (a file of flags vLLM reads past these "
        "checks).",
        "`max_lora_rank` must be one of the ranks vLLM takes (1, 8, 16, 32, 64, 128, 256, "
        "320, 512).",
        "`host` may be a bracketed IPv6 address (`[::1]`); vLLM gets it without brackets. "
        "It must not be empty or hold a space.",
    ],
    "ProxyConfig": [
        "`host` may be a bracketed IPv6 address (`[::1]`), bound without its brackets; it "
        "must not be empty or hold a space.",
        "`admin_key` (plaintext) may be given instead of `admin_key_sha256`: it is hashed "
        "while the config is validated and never kept, e.g. `OLP_PROXY__ADMIN_KEY`, which "
        "replaces a digest the file sets. Within one file both may not name different keys. "
        "Surrounding whitespace (a YAML block scalar's newline, a pasted blank) is removed "
        "first, as from a key a client presents and by `olp key hash`.",
        "`admin_key_sha256` must be 64 hex characters; null disables the admin API.",
        "`upstreams` must be http(s) base URLs without `/v1` and without a user name or password "
        "(the key goes in `upstream_api_key`).",
        "`policy_alias` must not also be one of `base_model_aliases` (a base alias always "
        "serves the base model).",
        "`pseudonym_key` must be 16 characters or more.",
        "`upstream_api_key` must not be empty (null: `policy.api_key`).",
    ],
    "TenantConfig": [
        "`api_key` (plaintext) may be given instead of `api_key_sha256`; it is hashed while "
        "the config is validated and never kept (surrounding whitespace removed first).",
        "`api_key_sha256` must be 64 hex characters (see `olp key hash`).",
        "`name` must not be `.` or `..`.",
    ],
    "StatePaths": [
        "`serving_state` and `records_dir` must be relative paths below the state dir: not "
        "empty, not absolute, no `..`.",
    ],
    "LearnerConfig": [
        "`min_batch` must not exceed `batch_size`.",
        "`max_batch` must not be below `batch_size`.",
        "With `ppo_clip_eps` set, `importance_cap` must be above 1 + `ppo_clip_eps` (PPO's "
        "dual clip at a lower cap stops the gradient of negative-advantage tokens inside the "
        "clip range).",
    ],
    "CustomPattern": ["`regex` must compile and must not match the empty string."],
    "AuditConfig": [
        "`safety.audit.path` must name a file: not empty, `.`, `..` or ending in `/`.",
    ],
    "RedactionConfig": [
        "`kinds` may only name built-in kinds; custom pattern names must be unique and must "
        "not reuse a built-in kind.",
    ],
    "ClassifierConfig": [
        "`kind: openai` needs `base_url` and `model`.",
        "`base_url` must not hold a user name or password (the key's variable goes in "
        "`api_key_env`).",
        "`base_url` must be an http:// or https:// URL with a host.",
    ],
    "KLGateConfig": [
        "`temperature` must be 1.0: vLLM reports the untempered model's logprobs, so tokens "
        "sampled at another temperature bias the KL estimate low.",
    ],
    "JudgeConfig": [
        "`base_url` must not hold a user name or password (the key goes in `api_key`).",
    ],
}


@dataclass(frozen=True)
class Key:
    """One documented key: where it lives, how to override it, what it accepts."""

    dotted: str
    env: str | None
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """A table of keys for one model reached at `dotted` (empty for the root)."""

    dotted: str
    model: type[BaseModel]
    keys: list[Key]
    is_list_item: bool


# ------------------------------------------------------------------ types and defaults
def type_name(annotation: Any) -> str:
    """A readable type, e.g. `int | None`, `list[str]`, `"kafka" | "jsonl"`."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if origin in (list, tuple, set):
        return f"list[{', '.join(type_name(a) for a in get_args(annotation) if a is not ...)}]"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map[{type_name(key)}, {type_name(value)}]"
    if annotation is Any:
        return "any"
    if annotation is Path:
        return "path"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation.__name__
    return getattr(annotation, "__name__", str(annotation))


def _portable(value: Any) -> Any:
    """Absolute paths inside the project become `<olp>/...`: the docs are machine-independent."""
    if isinstance(value, Path):
        if value.is_absolute() and value.is_relative_to(PROJECT_ROOT):
            return f"<olp>/{value.relative_to(PROJECT_ROOT).as_posix()}"
        return value.as_posix()
    if isinstance(value, list | tuple):
        return [_portable(v) for v in value]
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    return value


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "*required*"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(see below)"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()  # a default shipped in the code is no secret
    return f"`{json.dumps(_portable(value))}`"


def constraints(field: FieldInfo) -> list[str]:
    """The bounds pydantic enforces, as short phrases (`≥ 1`, `pattern ...`)."""
    out = []
    for meta in field.metadata:
        if isinstance(meta, at.Ge):
            out.append(f"≥ {meta.ge}")
        elif isinstance(meta, at.Gt):
            out.append(f"> {meta.gt}")
        elif isinstance(meta, at.Le):
            out.append(f"≤ {meta.le}")
        elif isinstance(meta, at.Lt):
            out.append(f"< {meta.lt}")
        elif isinstance(meta, at.MinLen):
            out.append(f"length ≥ {meta.min_length}")
        elif isinstance(meta, at.MaxLen):
            out.append(f"length ≤ {meta.max_length}")
        elif getattr(meta, "pattern", None):
            out.append(f"pattern `{meta.pattern}`")
    return out


# ------------------------------------------------------------------ source comments
def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Trailing `# ...` comments of each field's last line, from the class source."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef)
    out = {}
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = node.end_lineno or node.lineno
            if end in comments:
                out[node.target.id] = comments[end]
    return out


# ------------------------------------------------------------------ walking the models
def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """(model, is_list) when the field holds a model or a list of models."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, False
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        if inspect.isclass(item) and issubclass(item, BaseModel):
            return item, True
    return None, False


def env_name(path: list[str]) -> str | None:
    """The environment variable that overrides `path`, if `deploy.config` reads one."""
    if len(path) == 1:
        by_key = {key: name for name, key in TOP_LEVEL_ENV.items()}
        return by_key.get(path[0])
    if path[0] not in SECTIONS:
        return None
    return ENV_PREFIX + "__".join(p.upper() for p in path)


def walk(
    model: type[BaseModel], path: list[str], overridable: bool, is_list_item: bool = False
) -> Iterator[Section]:
    """Sections in document order: this model's table, then each nested model's."""
    comments = field_comments(model)
    keys: list[Key] = []
    nested: list[tuple[type[BaseModel], list[str], bool, bool]] = []
    for name, field in model.model_fields.items():
        child_path = [*path, name]
        child_model, is_list = _nested_model(field.annotation)
        description = field.description or comments.get(name, "")
        extra = constraints(field)
        if extra:
            description = "; ".join(p for p in [description, ", ".join(extra)] if p)
        if child_model is not None:
            item_path = [*path, f"{name}[]"] if is_list else child_path
            anchor = ".".join(item_path)
            see = f"see [`{anchor}`](#{_anchor(anchor)})"
            description = f"{description}; {see}" if description else see
            nested.append((child_model, item_path, overridable and not is_list, is_list))
        keys.append(
            Key(
                dotted=".".join(child_path),
                env=env_name(child_path) if overridable and child_model is None else None,
                type=type_name(field.annotation),
                default=default_text(field),
                description=description,
            )
        )
    yield Section(".".join(path), model, keys, is_list_item)
    for child_model, child_path, child_overridable, is_list in nested:
        yield from walk(child_model, child_path, child_overridable, is_list)


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def all_keys() -> list[Key]:
    return [key for section in walk(OlpConfig, [], True) for key in section.keys]


# ------------------------------------------------------------------ markdown
HEADER = f"""# Configuration reference

<!-- Generated from the config models by `{REGENERATE}`; do not edit by hand. -->

olp reads one YAML file (`olp <command> --config FILE`; without it the shipped
`deploy/default_config.yaml`). Every key has a default, unknown keys are errors, and invalid
values stop start-up with a message naming the dotted key (a rule across keys names their
section and the keys in its text). A number key given `true` or `false` is refused, not read as
1 or 0.

The defaults below are what a key left out of the file gets. The shipped file sets some keys
for a small demo on one machine: `learner.batch_size` 8, `learner.min_batch` 4,
`learner.max_batch` 8, `learner.batch_timeout_s` 20, `learner.lr` 0.001,
`learner.updates_per_batch` 2, `learner.num_threads` 1, `stream.join_window_s` 10, a
development admin key and a `demo` tenant (training off). A `--config FILE` replaces the
shipped file; it is not merged with it, so a file of your own starts from the defaults below.

## Environment overrides

Any key below a section can be set from the environment as `OLP_<SECTION>__<KEY>`, nested keys
joined by `__` (`OLP_SAFETY__GATES__KL__CAP=0.3`). A value that starts with `[` or `{{` is read
as a YAML flow list or mapping (`OLP_POLICY__EXTERNAL_URLS='[http://vllm:8100]'`), except
bracketed IPv6 addresses with ports (`OLP_STREAM__BOOTSTRAP_SERVERS='[::1]:9092'`) and, for a
`host` key, without one (`OLP_PROXY__HOST='[::1]'`); `null` or `~`
is null; any other value is taken verbatim and converted by the key's type
(`OLP_PROXY__PORT=9000`; booleans accept `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`). A
string key therefore gets the text as written: do not quote it (quotes would become part of the
value), and a numeric-looking name or key stays a string. An empty (or blank) value is refused,
naming the variable (`OLP_PROXY__HOST=${{UNSET}}` made the proxy listen on every interface):
unset the variable to keep the file's value. Environment values win over the file. A key given
twice in one mapping of the file is refused too, with both lines (YAML merge keys, `<<: *a`,
are read, and a key beside one overrides the merged key). A variable for a key and one for a key
below it apply in that order, whatever the environment's order: the mapping is set, then the key
below it (`OLP_SAFETY__GATES__KL='{{max_prompts: 8}}'` with `OLP_SAFETY__GATES__KL__CAP=0.3`
gives both); one below a key set to a value that is not a mapping is refused, naming both
variables. Of the top-level keys
only `state_dir`, `log_format` and `log_level` have overrides
(`OLP_STATE_DIR`, `OLP_LOG_FORMAT`, `OLP_LOG_LEVEL`). A list of entries (verifiers, custom
redaction patterns) is not set entry by entry: a YAML flow list in its variable replaces the
file's whole list (`OLP_LEARNER__REWARDS__VERIFIERS='[{{path: "m:f"}}]'`; a mapping given for
its section does too), so look for one left behind in a container's environment. Tenants are
set in the file only; `OLP_TENANTS__*`, `OLP_ON_CHILD_EXIT` and `OLP_MAX_RESTARTS` are
refused, naming the variable. So is a
misspelt name that would otherwise be ignored, naming the one meant: a key spelled with
single underscores (`OLP_PROXY_ADMIN_KEY`, `OLP_SAFETY_GATES_KL_CAP`: `OLP_PROXY__ADMIN_KEY`,
`OLP_SAFETY__GATES__KL__CAP`), or a first part that is no section
(`OLP_SAFETY_GATES__KL__CAP`). A whole section in one variable (`OLP_PROXY='{{port: 9001}}'`)
is refused too: its keys are set one by one.

Variables that are not config keys: `OLP_ADMIN_KEY` (the admin key the `olp` operator
commands and a standalone learner send), `OLP_CACHE_DIR` (prepared models and olpw
environments), `OLP_INTERNAL_ADMIN_TOKEN` (set by `olp up` for its children).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_markdown(section: Section) -> list[str]:
    lines = [f"## `{section.dotted}`" if section.dotted else "## Top level", ""]
    doc = section.model.__dict__.get("__doc__")
    if doc:
        lines += [" ".join(inspect.cleandoc(doc).split()), ""]
    if section.is_list_item:
        lines += ["A list; each entry holds the keys below.", ""]
    lines += [
        f"Model: `{section.model.__module__}.{section.model.__name__}`",
        "",
        "| key | type | default | env override | description |",
        "|---|---|---|---|---|",
    ]
    for key in section.keys:
        env = f"`{key.env}`" if key.env else "—"
        lines.append(
            f"| `{key.dotted}` | `{_cell(key.type)}` | {_cell(key.default)} | {env} "
            f"| {_cell(key.description)} |"
        )
    notes = NOTES.get(section.model.__name__, [])
    if notes:
        lines += ["", "Validation rules:", ""] + [f"- {note}" for note in notes]
    return [*lines, ""]


def render() -> str:
    """The whole reference as Markdown (deterministic: no dates, no absolute paths)."""
    lines = [HEADER]
    for section in walk(OlpConfig, [], True):
        lines += _section_markdown(section)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
