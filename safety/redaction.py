"""PII and secret redaction for everything that leaves the proxy or enters the audit log.

Each kind is one or more compiled patterns, run in a fixed order and only on strings that
hold one of the kind's needles (cheap substring checks); kinds that need more than a regex
(credit cards: Luhn; phone numbers: digit count; a value under a `token` name: that it looks
random) are confirmed by a validator. A rejected candidate is left as it was, unless its
kind offers parts of it to check instead (a card number's digit run that took the CVV
after it): then the first part that passes is replaced. Counts per kind are returned so
callers can export metrics. The built-in kinds' patterns live in
`safety/redaction_kinds.py`; this module runs them (and an operator's custom patterns).
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from safety.config import BUILTIN_REDACTION_KINDS, CustomPattern, RedactionConfig
from safety.redaction_kinds import (
    BUILTIN_PASSES_BY_KIND,
    MIN_BUILTIN_LENGTH,
    RedactionPass,
    card_number_ok,
)

_encode_msgpack = msgspec.msgpack.Encoder().encode

RedactionCounts = dict[str, int]


_SECRET_GROUP = re.compile(r"secret\d*")


def _shortest(needles: Iterable[str]) -> list[str]:
    """The needles that hold no other one (in order)."""
    needles = list(needles)
    return [n for n in needles if not any(o != n and o in n for o in needles)]


class _Needles:
    """Whether a text holds any needle of some kinds: a necessary condition for any of their
    patterns to match. Literals are searched as one alternation (Python's `re` finds
    literals fast, but an alternation that mixes in a case-blind part or a character class
    is tried at every position: several times slower), the case-blind literals with `in` on
    the lower-cased text, each other regex on its own."""

    def __init__(self, kinds: Iterable[RedactionPass]) -> None:
        kinds = list(kinds)
        self.always = any(not (k.needles or k.needles_ci or k.needle_regex) for k in kinds)
        # A needle that holds another one adds nothing to "any of them occurs" (`password=`
        # after `password`, `sk-ant-` after `sk-`), and each costs a search of every text
        # that holds none (most of them).
        folded = _shortest(dict.fromkeys(n.lower() for k in kinds for n in k.needles_ci))
        literals = [
            n
            for n in _shortest(dict.fromkeys(n for k in kinds for n in k.needles))
            if not any(f in n.lower() for f in folded)
        ]
        self._literals = re.compile("|".join(map(re.escape, literals))) if literals else None
        self._regexes = [
            re.compile(r) for r in dict.fromkeys(k.needle_regex for k in kinds) if r is not None
        ]
        self._folded = tuple(folded)

    def search(self, text: str, lowered: list[str]) -> bool:
        """`lowered` caches `text.lower()` between the calls for one text."""
        if self.always:
            return True
        if self._literals is not None and self._literals.search(text) is not None:
            return True
        # Plain loops: this runs for every pass on every string that holds any needle, and
        # an `any()` over a generator costs more than the searches of a short string.
        for regex in self._regexes:
            if regex.search(text) is not None:
                return True
        if not self._folded:
            return False
        if not lowered:
            lowered.append(text.lower())
        low = lowered[0]
        for needle in self._folded:  # noqa: SIM110 - a loop: see above
            if needle in low:
                return True
        return False


# Walking a JSON-like object, a string value is redacted on its own, without its key, so
# `{"password": "hunter2x"}` as a structure (feedback metadata, a request's `metadata`)
# matched no `secret_assignment` pattern that its JSON text matches. A key that may name a
# secret has its pair written out as JSON text and read by those same patterns instead
# (`_KEY_HINT` keeps that to the few keys worth the look).
_KEY_HINT = re.compile(r"(?i)pass|pwd|secret|token|key|cred|auth")
# `"authorization": "Basic …"` / `"Token …"` is a credential by its key alone (the value's
# scheme needs the header's name to be read as one), and no `secret_assignment` needle
# holds it: such pairs are always read.
_AUTH_KEY = re.compile(r"(?i)auth")
# An integer that may be a card number (13 to 19 digits), under a key that names one: as
# JSON text (`"card": 4111111111111111`) it was redacted, as a walked object's int it went
# out as it was.
_CARD_INT_MIN, _CARD_INT_END = 10**12, 10**19
# MessagePack's header of an unsigned 64-bit integer: how such an int shows in the fast
# path's encoding, which holds no digits of it. Every number below 2**63 has a first byte
# below 0x80 after it, which never follows 0xcf in UTF-8 text (0xcf leads a two-byte
# character there): text in Greek or Cyrillic is no false alarm.
_MSGPACK_UINT64 = re.compile(rb"\xcf[\x00-\x7f]")


# The keys a card number is stored under. Any integer that passes the card check was taken
# for one: a random 63-bit sampling `seed` passes it about one time in seventeen, and its
# record lost its token ids.
_CARD_KEY = re.compile(r"(?i)card|credit|(?:^|[_-])(?:cc|pan)(?:$|[_-])|ccnum|^pan$")


def _is_card_int(key: Any, value: int) -> bool:
    return (
        isinstance(key, str)
        and _CARD_KEY.search(key) is not None
        and _CARD_INT_MIN <= value < _CARD_INT_END
        and card_number_ok(str(value))
    )


def _is_logprob_entry(obj: Mapping[Any, Any]) -> bool:
    """vLLM's logprob entry (`token` with `logprob` or `bytes`): its `token` is the model's
    text, no key's value. A mapping with only a `bytes` key (a file's size beside its
    password) had its pairs left unread."""
    return "token" in obj and ("logprob" in obj or "bytes" in obj)


def _unused_key(out: dict[Any, Any], key: Any) -> Any:
    """`key`, or `key#2` (`#3`, ...) where an earlier key came out the same: metadata keyed by
    three e-mail addresses, each `[REDACTED:email]`, kept the last entry only."""
    if key not in out or not isinstance(key, str):
        return key
    number = 2
    while f"{key}#{number}" in out:
        number += 1
    return f"{key}#{number}"


def _may_hold_card_int(encoded: bytes) -> bool:
    """Whether an integer in this MessagePack encoding may be a card number."""
    for found in _MSGPACK_UINT64.finditer(encoded):
        value = int.from_bytes(encoded[found.start() + 1 : found.start() + 9], "big")
        if _CARD_INT_MIN <= value < _CARD_INT_END and card_number_ok(str(value)):
            return True
    return False


# The fast path of `redact_obj` searches the object's MessagePack encoding, where a key is
# followed by the header of its value, not by `": "`: `_Needles` for `token` names expects
# the JSON form. A name ending in `token` followed by the header of a string of 16 bytes or
# more (fixstr 0xb0-0xbf, str8 0xd9, str16 0xda; decoded with surrogateescape) is the
# encoding's form of a token that may be random enough to be a secret.
_MSGPACK_LONG_STR = frozenset([*map(chr, range(0xDCB0, 0xDCC0)), "\udcd9", "\udcda"])


def _has_msgpack_token_key(text: str) -> bool:
    """`token`/`Token`/`TOKEN` before a long string's header: `find` loops, since a
    case-blind regex took 24 µs on a 4 KB record and these take 5."""
    for stem in ("oken", "OKEN"):
        at = text.find(stem)
        while at != -1:
            if text[at + 4 : at + 5] in _MSGPACK_LONG_STR and text[at - 1 : at] in ("t", "T"):
                return True
            at = text.find(stem, at + 4)
    return False


def _validated_part(kind: RedactionPass, text: str) -> tuple[int, int] | None:
    """The first span of a rejected `text` that `kind.narrow` offers and `kind.validate`
    accepts. A pattern takes the longest run it can (a card number can have up to 19
    digits), so a short number written next to a card number joins it; once the match is
    made, the regex engine never tries the shorter run that is the card number."""
    if kind.narrow is None or kind.validate is None:
        return None
    for start, end in kind.narrow(text):
        if kind.validate(text[start:end]):
            return start, end
    return None


def replacement_for(kind: str) -> str:
    return f"[REDACTED:{kind}]"


_NUMBER = re.compile(r"\d+")
# A value after its quoted name and a colon: `"password": ` (JSON, a Python dict), also in
# JSON text held in a JSON string (`\"password\": `).
_NAME_AND_COLON = re.compile(r"(?P<quote>\\*[\"'])[ \t]*:[ \t]*\Z")


def _quote_of_bare_value(text: str, start: int) -> str | None:
    """The quote a number at `start` needs to stay a valid value once it is a marker: its
    name's (`"`, `\\"` in JSON text inside a string, `'` in a Python dict); None when it is
    no value after a name. `{"password": [REDACTED:secret_assignment]}` did not parse: a
    tool call's `arguments` no longer JSON for every reader of the record."""
    found = _NAME_AND_COLON.search(text, max(0, start - 80), start)
    return found.group("quote") if found else None


class _LongTextCache:
    """The redaction of long strings, least recently used dropped first, up to a number of
    characters in all.

    Why: a conversation's earlier messages, a tenant's system prompt and its tools'
    descriptions come back with every request, and every record redacted them again. On
    source code (which holds `@`, `://`, `token`: needles that send a text through the
    full passes) that is ~30 ms for 150,000 characters, in the sink's worker, per record.
    A string is its own key (its hash is computed once per string object)."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._chars = 0
        self._entries: dict[str, tuple[str, RedactionCounts]] = {}
        # The proxy redacts on its event loop and in its sink's feeder thread.
        self._lock = threading.Lock()

    def get(self, text: str) -> tuple[str, RedactionCounts] | None:
        with self._lock:
            hit = self._entries.pop(text, None)
            if hit is not None:
                self._entries[text] = hit  # now the most recently used
            return hit

    def put(self, text: str, result: tuple[str, RedactionCounts]) -> None:
        size = _cached_chars(text, result)
        if size > self._max_chars:
            return
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self._chars -= _cached_chars(text, old)
            self._entries[text] = result
            self._chars += size
            while self._chars > self._max_chars:
                oldest = next(iter(self._entries))
                self._chars -= _cached_chars(oldest, self._entries.pop(oldest))


def _cached_chars(text: str, result: tuple[str, RedactionCounts]) -> int:
    return len(text) + (len(result[0]) if result[0] is not text else 0)


# Strings shorter than this are redacted each time (cheap, and rarely the same twice).
_CACHED_MIN_CHARS = 2048
# Per Redactor (one per process that redacts): ~10 MB of ASCII text, four times that at most.
LONG_TEXT_CACHE_CHARS = 10_000_000
# `redact_obj` searches a structure's whole text first (one search, when nothing is found,
# instead of one per string) only up to this size.
_WHOLE_TEXT_SEARCH_MAX_CHARS = 16 * _CACHED_MIN_CHARS


class Redactor:
    """Replaces PII and secrets in strings and JSON-like objects with `[REDACTED:<kind>]`."""

    def __init__(
        self,
        kinds: Iterable[str] = BUILTIN_REDACTION_KINDS,
        custom_patterns: Iterable[CustomPattern] = (),
        enabled: bool = True,
        long_text_cache_chars: int = LONG_TEXT_CACHE_CHARS,
    ) -> None:
        """`long_text_cache_chars`: how many characters of long strings (and their
        redactions) to keep (`_LongTextCache`); 0 redacts every string every time."""
        self.enabled = enabled
        self._cache_chars = long_text_cache_chars
        kinds = list(kinds)
        unknown = sorted(set(kinds) - set(BUILTIN_PASSES_BY_KIND))
        if unknown:
            raise ValueError(f"unknown redaction kinds: {unknown}")
        # Custom patterns go first: an operator's pattern is more specific than ours.
        selected = [RedactionPass(p.name, p.regex) for p in custom_patterns]
        # What callers may rely on about the built-in passes alone (the proxy skips redacting
        # its own request ids, in which none of them can find anything).
        self.builtin_only = not selected
        # No built-in kind matches fewer than 6 characters (`a@b.co`), so shorter strings
        # are skipped; an operator's pattern may match less (a 5-character id).
        self._min_length = 1 if selected else MIN_BUILTIN_LENGTH
        selected += [
            kind
            for name, passes in BUILTIN_PASSES_BY_KIND.items()
            if name in kinds
            for kind in passes
        ]
        self.kinds: tuple[str, ...] = tuple(dict.fromkeys(k.name for k in selected))
        # One search per string decides whether any pass can match at all: most strings in
        # a trajectory hold none of the needles.
        # Passes with the same needles share one `_Needles`, asked once per text (the passes
        # of `secret_assignment`; `credit_card` and `phone`, with one digit-run regex).
        shared: dict[tuple[Any, ...], _Needles] = {}
        self._passes: list[tuple[RedactionPass, re.Pattern[str], _Needles]] = []
        for kind in selected:
            key = (kind.needles, kind.needles_ci, kind.needle_regex)
            if key not in shared:
                shared[key] = _Needles([kind])
            self._passes.append((kind, re.compile(kind.regex), shared[key]))
        self._any_needle = _Needles(selected)
        self._card_ints = "credit_card" in self.kinds
        assignments = [kind for kind in selected if kind.name == "secret_assignment"]
        # Whether a key/value pair reads as a secret assignment (None: the kind is off).
        self._assignment_needle = _Needles(assignments) if assignments else None
        self._long_texts = _LongTextCache(long_text_cache_chars)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled to the sink's worker process (with the record builder): without the cache
        # and its lock, which do not pickle; the copy starts its own.
        return {k: v for k, v in self.__dict__.items() if k != "_long_texts"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._long_texts = _LongTextCache(self._cache_chars)

    @classmethod
    def from_config(cls, config: RedactionConfig) -> Redactor:
        return cls(config.kinds, config.custom_patterns, enabled=config.enabled)

    def redact_text(self, text: str) -> tuple[str, RedactionCounts]:
        """Return the redacted text and how many matches of each kind were replaced."""
        if not self.enabled or len(text) < self._min_length:
            return text, {}
        if len(text) < _CACHED_MIN_CHARS or not self._cache_chars:
            return self._redact_text(text)
        cached = self._long_texts.get(text)
        if cached is None:
            cached = self._redact_text(text)
            self._long_texts.put(text, cached)
        redacted, counts = cached
        return redacted, dict(counts)  # the caller's own: the cache keeps its copy

    def _redact_text(self, text: str) -> tuple[str, RedactionCounts]:
        lowered: list[str] = []
        if not self._any_needle.search(text, lowered):
            return text, {}
        counts: dict[str, int] = {}
        found: dict[int, bool] = {}  # id of a `_Needles` -> whether the text holds one
        for kind, pattern, needle in self._passes:
            hit = found.get(id(needle))
            if hit is None:
                hit = found[id(needle)] = needle.search(text, lowered)
            if not hit:
                continue
            redacted = pattern.sub(self._replacer(kind, pattern, counts), text)
            if redacted != text:
                text = redacted
                lowered.clear()  # the next pass searches the redacted text
                found.clear()
        return text, counts

    @staticmethod
    def _replacer(
        kind: RedactionPass, pattern: re.Pattern[str], counts: dict[str, int]
    ) -> Callable[[re.Match[str]], str]:
        # A pattern marks its secret with a group named `secret` (one alternative may use
        # `secret2`, `secret3`, ...: a group name can occur only once in a pattern).
        secret_groups = [name for name in pattern.groupindex if _SECRET_GROUP.fullmatch(name)]

        def replace(match: re.Match[str]) -> str:
            found = match.group()
            if not found:
                # An operator's pattern can match nothing (`\b`, a lookahead); the config
                # check catches only patterns that match the empty text. Nothing is hidden
                # there, so nothing is inserted or counted.
                return found
            group = next((g for g in secret_groups if match.start(g) >= 0), None)
            # Only the named group is the secret; the rest (a URL's host, a header name)
            # stays readable.
            if group is None:
                start, end = 0, len(found)
            else:
                start, end = match.start(group) - match.start(), match.end(group) - match.start()
            if kind.validate is not None and not kind.validate(found[start:end]):
                part = _validated_part(kind, found[start:end])
                if part is None:
                    return found
                start, end = start + part[0], start + part[1]
            counts[kind.name] = counts.get(kind.name, 0) + 1
            marker = replacement_for(kind.name)
            if _NUMBER.fullmatch(found, start, end):
                quote = _quote_of_bare_value(match.string, match.start() + start)
                marker = f"{quote}{marker}{quote}" if quote else marker
            return found[:start] + marker + found[end:]

        return replace

    def redact_obj(self, obj: Any) -> tuple[Any, RedactionCounts]:
        """A copy of a JSON-like structure with every string (values and keys) redacted.

        Only JSON types are walked: str, int, float, bool, None, lists (and tuples) and
        mappings with such keys. Anything else (bytes, a dataclass, a msgspec Struct, a set)
        raises TypeError rather than being passed through unread: its text could hold a
        secret this walk would never see.

        When no needle occurs anywhere in the structure's encoded text (the usual case),
        nothing can be redacted and `obj` itself is returned: callers must not modify the
        result. The text is the MessagePack encoding read as UTF-8: every string (and the
        content of any bytes value) appears in it as itself, and no needle depends on what
        comes before it, so the one search is a necessary condition for any string inside to
        need redaction (JSON, by contrast, writes bytes as base64, which hides a needle).

        A structure over 32,768 characters is walked instead: its strings of 2,048
        characters or more are redacted once and then taken from a cache (`_LongTextCache`)."""
        if not self.enabled:
            return obj, {}
        if not self._any_needle.always:
            try:
                encoded = _encode_msgpack(obj)
                text = encoded.decode("utf-8", "surrogateescape")
            except (TypeError, ValueError, OverflowError):
                text = None  # not encodable (a lone surrogate, a huge int): walk it
            else:
                if self._card_ints and _may_hold_card_int(encoded):
                    text = None
            if (
                text is not None
                # A long structure is walked: its long strings may be in the cache, where
                # the search of its whole text would read every one of them again (the walk
                # reads the others as this search would, one string at a time).
                and (len(text) <= _WHOLE_TEXT_SEARCH_MAX_CHARS or not self._cache_chars)
                and not self._any_needle.search(text, [])
                and (self._assignment_needle is None or not _has_msgpack_token_key(text))
            ):
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
            keyed = self._assignment_needle is not None and not _is_logprob_entry(obj)
            out = {}
            for key, value in obj.items():
                walked = self._walk(value, counts)
                if type(value) is int and self._card_ints and _is_card_int(key, value):
                    counts["credit_card"] += 1
                    walked = replacement_for("credit_card")
                pair_kind = self._secret_pair(key, value) if keyed and walked is value else None
                if pair_kind is not None:
                    counts[pair_kind] += 1
                    walked = replacement_for(pair_kind)
                out[_unused_key(out, self._walk_key(key, counts))] = walked
            return out
        if kind is list or isinstance(obj, list | tuple):
            if (
                obj
                and not isinstance(obj[0], str | Mapping | list | tuple)
                and all(isinstance(value, int | float | bool) or value is None for value in obj)
            ):
                return list(obj)  # token ids, logprobs: nothing to redact
            return [self._walk(value, counts) for value in obj]
        if obj is None or isinstance(obj, int | float):  # bool is an int
            return obj
        raise _unsupported(obj)

    def _secret_pair(self, key: Any, value: Any) -> str | None:
        """The kind `key: value` written as JSON is redacted as (`"db_pass": "…"`, a
        random-looking `"access_token": "…"`, `"password": 12345678`), or None.

        Any kind counts, not only `secret_assignment`: the key-anchored kinds run first
        (`aws_access_key` for `"aws_secret_access_key": "…"`, `basic_auth` for
        `"authorization": "Basic …"`) and took the match, so those values stayed in a walked
        object while the same pair as JSON text was redacted."""
        if not isinstance(key, str) or _KEY_HINT.search(key) is None:
            return None
        if isinstance(value, bool) or not isinstance(value, str | int):
            return None
        assert self._assignment_needle is not None
        pair = json.dumps({key: value}, ensure_ascii=False)  # any int: JSON has no bound
        header = isinstance(value, str) and _AUTH_KEY.search(key) is not None
        if not header and not self._assignment_needle.search(pair, []):
            return None
        _, found = self.redact_text(pair)
        if "secret_assignment" in found or not found:
            return "secret_assignment" if found else None
        return next(iter(found))

    def _walk_key(self, key: Any, counts: Counter[str]) -> Any:
        if isinstance(key, str):
            return self._walk(key, counts)
        if key is None or isinstance(key, int | float):
            return key
        raise _unsupported(key, "dict key")


def _unsupported(obj: Any, what: str = "value") -> TypeError:
    return TypeError(
        f"cannot redact a {what} of type {type(obj).__name__}: only JSON types (str, int, "
        "float, bool, None, lists, dicts) are walked, and anything else could hold a secret "
        "that would pass unread; convert it first (e.g. msgspec.to_builtins)"
    )


def merge_counts(*all_counts: Mapping[str, int]) -> RedactionCounts:
    """Sum several count dicts (e.g. request and response redactions of one trajectory)."""
    total: Counter[str] = Counter()
    for counts in all_counts:
        total.update(counts)
    return dict(total)
