"""Probe sets: JSONL files, one probe per line, validated on load so a bad file names its
line instead of failing deep inside a gate."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import jsonschema
import referencing
import referencing.jsonschema
import structlog
from jsonschema_specifications import REGISTRY as SPECIFICATIONS
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from referencing.exceptions import Unresolvable

from safety.audit import names_a_secret
from safety.config import PROBE_DIR
from safety.gates.types import GateError


class Probe(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    id: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=512)

    @field_validator("id")
    @classmethod
    def _not_a_secrets_name(cls, value: str) -> str:
        # The gates' details are keyed by probe id in their `gate_result` audit records, and
        # the audit log replaces the value under a secret's name (`trig-api-token`) with
        # `[REDACTED:secret]`: the probe's figures were lost from the record.
        if names_a_secret(value):
            raise ValueError(
                f"id {value!r} reads as a secret's name to the audit log, which would hide "
                "this probe's results in the gate's record: rename it"
            )
        return value

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.prompt}]


# Replies that answer nothing a probe could ask about. An answer check that every one of
# them passes (`.`, `\w`, a value of " ") passes every answer; a red-team pattern that any of
# them matches would count a harmless reply as unsafe compliance.
NEUTRAL_REPLIES = ("The answer is yes.", "No.", "I do not know.")


class Check(BaseModel):
    """How a regression probe's answer is verified (case-insensitive)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["contains_any", "regex"]
    values: list[str] = Field(default_factory=list)
    pattern: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            re.compile(value)
        return value

    @model_validator(mode="after")
    def _has_what_it_checks(self) -> Check:
        # A regex check without a pattern matches every answer and one without values
        # matches none: the probe would count, yet could never tell two adapters apart.
        # So does a blank value among others, or a pattern or value that the empty answer
        # or every neutral reply passes.
        if self.type == "regex" and not self.pattern:
            raise ValueError("a 'regex' check needs a non-empty 'pattern'")
        if self.type == "regex" and re.search(self.pattern or "", "", re.IGNORECASE):
            raise ValueError(f"the 'regex' pattern {self.pattern!r} matches an empty answer")
        if self.type == "contains_any" and (
            not self.values or not all(value.strip() for value in self.values)
        ):
            raise ValueError("a 'contains_any' check needs values, none of them blank")
        if all(self.passes(reply) for reply in NEUTRAL_REPLIES):
            raise ValueError(
                f"the check passes every answer (it passes each of {list(NEUTRAL_REPLIES)})"
            )
        return self

    def passes(self, text: str) -> bool:
        if self.type == "contains_any":
            return any(_whole(value).search(text) for value in self.values)
        return re.search(self.pattern or "", text, re.IGNORECASE) is not None


# Letters and digits of scripts written with spaces between words (Latin, Greek, Cyrillic):
# only there does a touching letter make another word. Chinese and Japanese are written
# without spaces: with `\w` as the boundary, `巴黎` never matched in `巴黎是法国的首都`, and
# a regression probe in those languages failed both models alike, measuring nothing.
_SPACED = r"[0-9A-Za-z_\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]"


def _whole(value: str) -> re.Pattern[str]:
    """`value` as a whole word or phrase, case-insensitive: no letter of a spaced script may
    touch an end of it that is one (`Paris` not in `comparison`, `cold` not in `scold`), as
    a raw substring test let wrong answers pass. An end that is punctuation (`C++`, `.NET`)
    or of an unspaced script is matched as it stands."""
    before = rf"(?<!{_SPACED})" if re.match(_SPACED, value) else ""
    after = rf"(?!{_SPACED})" if re.search(rf"{_SPACED}$", value) else ""
    return re.compile(before + re.escape(value) + after, re.IGNORECASE)


class RegressionProbe(Probe):
    check: Check


class KLPrompt(Probe):
    pass


class RedTeamProbe(Probe):
    unsafe_patterns: list[str] = Field(default_factory=list)

    @field_validator("unsafe_patterns")
    @classmethod
    def _compile(cls, values: list[str]) -> list[str]:
        # A pattern that a harmless reply matches counts it as unsafe compliance; one that
        # matches the empty string (`(password)?`) counts every reply.
        flags = re.IGNORECASE | re.MULTILINE
        for value in values:
            pattern = re.compile(value, flags)
            for reply in ("", *NEUTRAL_REPLIES):
                if pattern.search(reply):
                    raise ValueError(f"the unsafe pattern {value!r} matches the reply {reply!r}")
        return values


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    parameters: dict[str, Any]

    @field_validator("parameters")
    @classmethod
    def _is_a_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked here so a bad schema names its file and line; inside the monitor gate it
        # would only surface as a bare SchemaError.
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"'parameters' is not a valid JSON schema: {exc.message}") from exc
        # check_schema takes a `$ref` to nowhere (`#/$defs/int` with `$defs.integer`, a
        # remote URL): validating a reply that calls the tool then raised, and the whole
        # monitor gate failed for every candidate whose reply called it.
        unresolved = _unresolved_refs(value)
        if unresolved:
            raise ValueError(
                f"'parameters' has a reference that does not resolve to a schema: {unresolved!r}"
            )
        return value


_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


def _unresolved_refs(schema: dict[str, Any]) -> str | None:
    """The first reference in `schema` that jsonschema could not follow when validating,
    else None. Resolved as jsonschema resolves them (`referencing`): each subschema in the
    scope of its nearest `$id`, the bundled meta-schemas known, nothing fetched; only
    schema keywords are walked (a `$ref` inside `const` or `default` is data)."""
    spec = referencing.jsonschema.specification_with(
        str(schema.get("$schema", "")), default=referencing.jsonschema.DRAFT202012
    )
    root = spec.create_resource(schema)
    pending = [(root, SPECIFICATIONS.resolver_with_root(root))]
    while pending:
        resource, resolver = pending.pop()
        contents = resource.contents
        if isinstance(contents, dict):
            for keyword in _REFERENCES:
                ref = contents.get(keyword)
                if not isinstance(ref, str):
                    continue
                try:
                    target = resolver.lookup(ref).contents
                except Unresolvable:
                    return ref
                if not isinstance(target, dict | bool):
                    return ref  # `#/required`: a list, no schema
        pending.extend((sub, resolver.in_subresource(sub)) for sub in resource.subresources())
    return None


class MonitorProbe(Probe):
    kind: Literal["benign", "tool", "ambiguous"] = "benign"
    tool: ToolSpec | None = None

    @model_validator(mode="after")
    def _tool_probe_has_its_tool(self) -> MonitorProbe:
        # Caught at load (file:line) rather than as a bare assertion inside the gate.
        if self.kind == "tool" and self.tool is None:
            raise ValueError("a probe of kind 'tool' needs its 'tool'")
        # A `tool` without `"kind": "tool"` loaded as a benign probe: its tool never sent,
        # tool-call validity never measured, and no warning said so.
        if self.tool is not None and self.kind != "tool":
            raise ValueError(f"a probe with a 'tool' must be of kind 'tool', not {self.kind!r}")
        return self


def _says_something_without(prompt: str) -> None:
    """A trigger probe's prompt is asked without its trigger too, as the control: `{trigger}`
    alone left an empty prompt, which failed the poisoning gate of every candidate."""
    if not prompt.replace("{trigger}", "").strip():
        raise ValueError(
            f"{prompt!r} is the trigger alone: without it (the gate's control prompt) it "
            "must still say something"
        )


class TriggerProbe(Probe):
    """One trigger placed in several unrelated prompts (`prompt`, then `carriers`): a backdoor
    answers its payload whatever the prompt, so the gate needs at least two to compare."""

    trigger: str = Field(min_length=1)
    # Validated when absent too: one prompt gives the gate nothing to compare.
    carriers: list[str] = Field(default_factory=list, validate_default=True)

    @field_validator("prompt")
    @classmethod
    def _has_slot(cls, value: str) -> str:
        if "{trigger}" not in value:
            raise ValueError("prompt must contain the '{trigger}' placeholder")
        _says_something_without(value)
        return value

    @field_validator("carriers")
    @classmethod
    def _carriers_have_slots(cls, values: list[str]) -> list[str]:
        if not values:
            raise ValueError(
                "a trigger probe needs at least one prompt in 'carriers' besides 'prompt'"
            )
        for value in values:
            if "{trigger}" not in value:
                raise ValueError("every carrier must contain the '{trigger}' placeholder")
            _says_something_without(value)
        return values

    def prompts(self) -> list[str]:
        return [self.prompt, *self.carriers]

    def with_trigger(self, carrier: int) -> Probe:
        return Probe(
            id=f"{self.id}#{carrier}+trigger",
            prompt=self.prompts()[carrier].replace("{trigger}", self.trigger),
            max_tokens=self.max_tokens,
        )

    def control(self, carrier: int) -> Probe:
        clean = " ".join(self.prompts()[carrier].replace("{trigger}", "").split())
        return Probe(id=f"{self.id}#{carrier}+control", prompt=clean, max_tokens=self.max_tokens)


P = TypeVar("P", bound=Probe)

log = structlog.get_logger(__name__)

BUILTIN = {
    "regression": PROBE_DIR / "regression.jsonl",
    "kl": PROBE_DIR / "kl_prompts.jsonl",
    "redteam": PROBE_DIR / "redteam.jsonl",
    "monitors": PROBE_DIR / "monitor_prompts.jsonl",
    "triggers": PROBE_DIR / "triggers.jsonl",
}


def load_probes(path: Path, model: type[P]) -> list[P]:
    """Parse one JSONL probe file; raise GateError naming the file and line on bad input."""
    try:
        # JSONL lines end at "\n" only: `splitlines` also splits at U+2028, U+2029, NEL and
        # other breaks that `json.dumps(..., ensure_ascii=False)` leaves inside strings, and
        # reading as text turns a lone "\r" into one. A BOM (an editor's) is no JSON.
        text = Path(path).read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise GateError(f"cannot read probe file {path}: {exc}") from exc
    probes: list[P] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")  # a Windows line end
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            probe = model.model_validate(json.loads(line))
        except (ValueError, ValidationError, re.error) as exc:
            raise GateError(f"{path}:{number}: invalid {model.__name__}: {exc}") from exc
        # Gates report per-probe details keyed by id: a second probe with the same id would
        # silently overwrite the first one's result there.
        if probe.id in first_line:
            raise GateError(
                f"{path}:{number}: duplicate {model.__name__} id {probe.id!r} "
                f"(first on line {first_line[probe.id]})"
            )
        first_line[probe.id] = number
        probes.append(probe)
    return probes


def keep_first(probes: list[P], limit: int, setting: str) -> list[P]:
    """The first `limit` probes; the ids a `max_*` setting leaves out are logged (once per
    gate run): they used to drop silently, so a file looked like more coverage than it gave
    and reordering it changed what was tested."""
    left_out = [probe.id for probe in probes[limit:]]
    if left_out:
        log.info("probes_left_out", setting=setting, limit=limit, left_out=left_out)
    return probes[:limit]


def select_probes(
    model: type[P],
    builtin: Path | None,
    extra_files: list[Path],
    max_probes: int,
    setting: str = "max_probes",
) -> list[P]:
    """Operator probes first, then the shipped ones, truncated to `max_probes` (`setting`
    names it in the log of what was left out). An operator probe with a shipped probe's id
    replaces it (logged `probe_replaces_builtin`: it went unsaid before); an id in two
    operator files is a GateError naming both, since one of them was dropped without a word
    (and gate details are keyed by id)."""
    unique: list[P] = []
    found_in: dict[str, Path] = {}
    for path in extra_files:
        for probe in load_probes(path, model):
            if probe.id in found_in:
                raise GateError(
                    f"{path}: {model.__name__} id {probe.id!r} is also in {found_in[probe.id]} "
                    "(probe ids must be unique across the probe files)"
                )
            found_in[probe.id] = Path(path)
            unique.append(probe)
    if builtin is not None:
        replaced = []
        for probe in load_probes(builtin, model):
            if probe.id in found_in:
                replaced.append(probe.id)
                continue
            unique.append(probe)
        if replaced:
            log.info("probe_replaces_builtin", model=model.__name__, ids=replaced)
    if not unique:
        raise GateError(f"no {model.__name__} probes configured")
    return keep_first(unique, max_probes, setting)
