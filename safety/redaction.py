"""PII and secret redaction for everything that leaves the proxy or enters the audit log.

One compiled alternation scans each string once; kinds that need more than a regex (credit
cards: Luhn; phone numbers: digit count) are confirmed by a validator, and a rejected
candidate is left as it was. Counts per kind are returned so callers can export metrics.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from safety.config import BUILTIN_REDACTION_KINDS, CustomPattern, RedactionConfig

_encode_json = msgspec.json.Encoder().encode

RedactionCounts = dict[str, int]


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum every payment card number carries."""
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if position % 2 == 1:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _credit_card_ok(text: str) -> bool:
    digits = re.sub(r"[ -]", "", text)
    # Issuer prefixes start with 2-6; this keeps millisecond timestamps and ids out.
    return (
        13 <= len(digits) <= 19
        and digits[0] in "23456"
        and len(set(digits)) > 1
        and luhn_ok(digits)
    )


def _phone_ok(text: str) -> bool:
    digits = sum(c.isdigit() for c in text)
    return 8 <= digits <= 15


@dataclass(frozen=True)
class _Kind:
    name: str
    regex: str
    validate: Callable[[str], bool] | None = None
    # The pattern is only run when one of these substrings occurs (cheap `in` checks).
    needles: tuple[str, ...] = ()
    # ...or, instead of substrings, where this regex matches (a necessary condition).
    needle_regex: str | None = None


# Passes run in this order, each on the output of the previous one, so the more specific
# formats claim a span before the generic ones (anthropic before openai, jwt before bearer,
# credit cards before phone numbers); a `[REDACTED:...]` marker matches no later pattern.
# Card and phone numbers that pass their validators hold at least 8 digits, written with
# only digits, spaces, dots, dashes, parentheses and `+` between the first and last digit.
_DIGIT_RUN = r"\d[\d .()+-]{6,}\d"
_AWS_KEY_ID = r"(?:AKIA|ASIA|ABIA|ACCA|AROA|AIDA)[0-9A-Z]{16}"
_AWS_SECRET = r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
_KEY_BODY = r"(?=[a-z_-]*[A-Z0-9])[A-Za-z0-9_-]{20,}"  # with an upper-case letter or digit
_BUILTIN: dict[str, _Kind] = {
    k.name: k
    for k in (
        _Kind(
            "private_key",
            # The whole block; without its END line (an answer cut off by max_tokens, a
            # partial paste) the BEGIN line and every base64 or header line after it.
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"(?:[\s\S]*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
            r"|(?:[ \t]*(?:\r?\n|\\n)(?:[A-Za-z0-9+/=]+|[A-Za-z-]+:[^\r\n]*))*)",
            needles=("PRIVATE KEY",),
        ),
        _Kind(
            "jwt",
            r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{8,}",
            needles=("eyJ",),
        ),
        # Real key bodies are random base62/base64url and so hold an upper-case letter or a
        # digit (`_KEY_BODY`); an all-lower-case kebab/snake name (`sk-learn-model-selection-
        # helpers`, `sk-ant-design-...`) is an identifier, not a key.
        _Kind(
            "anthropic_key",
            rf"\bsk-ant-[A-Za-z0-9]{{2,10}}-{_KEY_BODY}",
            needles=("sk-ant-",),
        ),
        _Kind(
            "openai_key",
            rf"\bsk-(?:proj-|svcacct-|admin-|None-)?{_KEY_BODY}",
            needles=("sk-",),
        ),
        _Kind(
            "aws_access_key",
            # The key id, and its 40-character secret where it is recognisable: right after
            # the id (the IAM credentials CSV) or after a `secret access key` name (the
            # credentials file, env vars, boto3 arguments, STS JSON). The id alone is not
            # the credential; leaving the secret next to it would leak the part that is.
            rf"\b{_AWS_KEY_ID}\b"
            rf"|(?<=\b{_AWS_KEY_ID}[ \t,;:|]){_AWS_SECRET}"
            r"|(?i:aws[_-]?secret[_-]?key|secret[_-]?access[_-]?key)(?:\\?[\"'])?[ \t]*"
            rf"(?:=>|[:=])[ \t]*(?:\\?[\"'])?(?P<secret>{_AWS_SECRET})",
            needle_regex=r"A(?:KIA|SIA|BIA|CCA|ROA|IDA)|(?i:secret[_-]?(?:access|key))",
        ),
        _Kind(
            "github_token",
            r"\b(?:(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})\b",
            needles=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
        ),
        _Kind(
            "gitlab_token",  # personal, project, deploy, runner, trigger, OAuth app tokens
            r"\bgl(?:pat|dt|rt|ptt|cbt|oas|imt|ft|soat)-[A-Za-z0-9_-]{20,}",
            # No `\b` in a needle: `redact_obj` searches JSON text, where the newline
            # before a token at the start of a line is `\n`, a word character before it.
            needle_regex=r"gl[a-z]{2,4}-",
        ),
        _Kind(
            "slack_token",  # bot/user tokens, app-level tokens, incoming-webhook URLs
            r"\bxox[abposre]-[A-Za-z0-9-]{10,}|\bxapp-[0-9]-[A-Za-z0-9-]{10,}"
            r"|\bhooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]{20,}",
            needles=("xox", "xapp-", "hooks.slack.com/"),
        ),
        _Kind(
            "stripe_key",
            r"\b[rs]k_(?:live|test)_[A-Za-z0-9]{16,}",
            needles=("k_live_", "k_test_"),
        ),
        _Kind("huggingface_token", r"\bhf_[A-Za-z0-9]{30,}\b", needles=("hf_",)),
        _Kind("google_api_key", r"\bAIza[0-9A-Za-z_-]{35}", needles=("AIza",)),
        _Kind(
            "bearer_token",
            r"\b(?i:bearer)[ \t]+[A-Za-z0-9._~+/-]{16,}=*",
            needle_regex=r"(?i:earer)",
        ),
        _Kind(
            "basic_auth",  # only after an Authorization name: "basic" is a common word
            # Quotes may be escaped (`\"authorization\": \"Basic ...\"`: nested JSON in a
            # tool's string argument), as for the AWS secret's name above.
            r"(?i:authorization(?:\\?[\"'])?[ \t]*[:=][ \t]*(?:\\?[\"'])?basic)[ \t]+"
            r"(?P<secret>[A-Za-z0-9+/]{8,}={0,2})",
            needle_regex=r"(?i:basic)",
        ),
        _Kind(
            "url_password",  # scheme://user:password@host keeps all but the password
            # Userinfo lives only in the authority, which ends at the first `/`, `?` or `#`:
            # an `@` in the path, query or fragment (`host:8000?email=a@b.com`) is not a
            # password. The one exception: a pasted DSN's unescaped `P#ss` / `pa?ss` is still
            # a secret, so `?` and `#` may sit in the password unless the text before them is
            # a port (digits: `host:8000?` ends the authority). The password runs to the
            # authority's last `@` (as urllib reads it), so an unescaped `P@ssw0rd` goes
            # whole. No part crosses a `"` or an angle bracket (never valid in userinfo), so
            # `{"u":"http://host:80","to":"a@b.co"}` does not read as a password running into
            # the next JSON string; the extra `@` parts stop at a `'` too. The user part holds
            # no `[`: `http://[::1]:8000` is a host.
            r"\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#\s:@\"<>\[\]]*:"
            r"(?P<secret>(?!\d*[?#])[^/\s@\"<>]+(?:@[^/?#\s@\"'<>]+)*)@",
            needles=("://",),
        ),
        _Kind(
            "email",
            r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
            needles=("@",),
        ),
        _Kind(
            "credit_card",
            # Not touching a letter or digit on either side, nor a dash-joined one: a digit
            # run inside a hex hash or a UUID is not a card number.
            r"(?<![\w.])(?<!\w-)\d(?:[ -]?\d){12,18}(?!\w|\.\d|-\w)",
            _credit_card_ok,
            needle_regex=_DIGIT_RUN,
        ),
        _Kind(
            "phone",
            r"(?<![\w+.])(?:\+\d{1,3}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}(?:[ .-]?\d{2,4}){1,4}"
            r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}|\d{3}[.-]\d{3}[.-]\d{4})(?!\w|\.\d)",
            _phone_ok,
            needle_regex=_DIGIT_RUN,
        ),
    )
}
assert tuple(_BUILTIN) == BUILTIN_REDACTION_KINDS
_MIN_BUILTIN_LENGTH = 6  # the shortest text any built-in kind matches


def _needle_source(kind: _Kind) -> str | None:
    if kind.needle_regex is not None:
        return kind.needle_regex
    if not kind.needles:
        return None
    return "|".join(re.escape(n) for n in dict.fromkeys(kind.needles))


def _needle_regex(kinds: list[_Kind]) -> re.Pattern[str] | None:
    """A pattern that finds any needle of these kinds; None when one of them has none (it
    must always run)."""
    sources = [_needle_source(kind) for kind in kinds]
    if not sources or any(source is None for source in sources):
        return None
    return re.compile("|".join(dict.fromkeys(s for s in sources if s is not None)))


def replacement_for(kind: str) -> str:
    return f"[REDACTED:{kind}]"


class Redactor:
    """Replaces PII and secrets in strings and JSON-like objects with `[REDACTED:<kind>]`."""

    def __init__(
        self,
        kinds: Iterable[str] = BUILTIN_REDACTION_KINDS,
        custom_patterns: Iterable[CustomPattern] = (),
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        kinds = list(kinds)
        unknown = sorted(set(kinds) - set(_BUILTIN))
        if unknown:
            raise ValueError(f"unknown redaction kinds: {unknown}")
        # Custom patterns go first: an operator's pattern is more specific than ours.
        selected = [_Kind(p.name, p.regex) for p in custom_patterns]
        # No built-in kind matches fewer than 6 characters (`a@b.co`), so shorter strings
        # are skipped; an operator's pattern may match less (a 5-character id).
        self._min_length = 1 if selected else _MIN_BUILTIN_LENGTH
        selected += [kind for name, kind in _BUILTIN.items() if name in kinds]
        self.kinds: tuple[str, ...] = tuple(k.name for k in selected)
        # One search per string decides whether any pass can match at all: most strings in
        # a trajectory hold none of the needles, and a regex search is far cheaper than a
        # Python loop over every kind's needles.
        self._passes = [(kind, re.compile(kind.regex), _needle_regex([kind])) for kind in selected]
        self._any_needle = _needle_regex(selected)

    @classmethod
    def from_config(cls, config: RedactionConfig) -> Redactor:
        return cls(config.kinds, config.custom_patterns, enabled=config.enabled)

    def redact_text(self, text: str) -> tuple[str, RedactionCounts]:
        """Return the redacted text and how many matches of each kind were replaced."""
        if not self.enabled or len(text) < self._min_length:
            return text, {}
        if self._any_needle is not None and self._any_needle.search(text) is None:
            return text, {}
        counts: dict[str, int] = {}
        for kind, pattern, needle in self._passes:
            if needle is not None and needle.search(text) is None:
                continue
            text = pattern.sub(self._replacer(kind, counts), text)
        return text, counts

    @staticmethod
    def _replacer(kind: _Kind, counts: dict[str, int]) -> Callable[[re.Match[str]], str]:
        def replace(match: re.Match[str]) -> str:
            found = match.group()
            if not found:
                # An operator's pattern can match nothing (`\b`, a lookahead); the config
                # check catches only patterns that match the empty text. Nothing is hidden
                # there, so nothing is inserted or counted.
                return found
            if kind.validate is not None and not kind.validate(found):
                return found
            counts[kind.name] = counts.get(kind.name, 0) + 1
            if "secret" in match.re.groupindex and match.start("secret") >= 0:
                # Only the named group is the secret; the rest (a URL's host, a header
                # name) stays readable.
                start, end = match.span("secret")
                offset = match.start()
                return found[: start - offset] + replacement_for(kind.name) + found[end - offset :]
            return replacement_for(kind.name)

        return replace

    def redact_obj(self, obj: Any) -> tuple[Any, RedactionCounts]:
        """A copy of a JSON-like structure with every string (values and keys) redacted.

        When no needle occurs anywhere in the structure's JSON text (the usual case), nothing
        can be redacted and `obj` itself is returned: callers must not modify the result.
        JSON writes every needle character as itself, and no needle depends on what comes
        before it (no word boundary: an escaped newline is a backslash and an `n`), so the
        one search over the encoded text is a necessary condition for any string inside to
        need redaction."""
        if not self.enabled:
            return obj, {}
        if self._any_needle is not None:
            try:
                text = _encode_json(obj).decode("utf-8")
            except (TypeError, ValueError, OverflowError):
                text = None  # not plain JSON (e.g. a tuple key): walk it
            if text is not None and self._any_needle.search(text) is None:
                return obj, {}
        counts: Counter[str] = Counter()
        result = self._walk(obj, counts)
        return result, dict(counts)

    def _walk(self, obj: Any, counts: Counter[str]) -> Any:
        # Exact-type checks first: this runs on every captured record, and JSON gives
        # plain str/dict/list; subclasses and tuples take the general path below.
        kind = type(obj)
        if kind is str or isinstance(obj, str):
            if len(obj) < self._min_length:
                return obj
            text, found = self.redact_text(obj)
            if found:
                counts.update(found)
            return text
        if kind is dict or isinstance(obj, Mapping):
            # Keys too: client metadata may be keyed by an e-mail address or a key.
            return {
                (self._walk(key, counts) if type(key) is str else key): self._walk(value, counts)
                for key, value in obj.items()
            }
        if kind is list or isinstance(obj, list | tuple):
            if (
                obj
                and not isinstance(obj[0], str | Mapping | list | tuple)
                and all(isinstance(value, int | float | bool) or value is None for value in obj)
            ):
                return list(obj)  # token ids, logprobs: nothing to redact
            return [self._walk(value, counts) for value in obj]
        return obj


def merge_counts(*all_counts: Mapping[str, int]) -> RedactionCounts:
    """Sum several count dicts (e.g. request and response redactions of one trajectory)."""
    total: Counter[str] = Counter()
    for counts in all_counts:
        total.update(counts)
    return dict(total)
