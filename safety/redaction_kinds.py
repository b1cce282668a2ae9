"""The built-in redaction kinds: one or more regex passes each, with the needles that say
where a pass can match and the validators that confirm a match (Luhn for card numbers, digit
counts for phone numbers, randomness for a value under a `token` name).

The patterns are kept apart from the engine that runs them (`safety/redaction.py`), which
is small by comparison; docs/security.md says what each kind matches and what it leaves.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from safety.config import BUILTIN_REDACTION_KINDS


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


# What separates a number's groups: a space (also the non-breaking and narrow ones of text
# copied from web pages and French number formatting) or a dash (also the non-breaking one).
# With only ` ` and `-`, `4111\u00a01111\u00a01111\u00a01111` was no card number.
_GAP = " \u00a0\u202f\u2009"
_DASHES = "\u2011-"


def card_number_ok(text: str) -> bool:
    digits = re.sub(f"[{_GAP}{_DASHES}]", "", text)
    # Issuer prefixes start with 2-6; this keeps millisecond timestamps and ids out.
    return (
        13 <= len(digits) <= 19
        and digits[0] in "23456"
        and len(set(digits)) > 1
        and luhn_ok(digits)
    )


def _card_number_parts(text: str) -> list[tuple[int, int]]:
    """The spans of whole space-separated groups inside a digit run that failed the card
    check, most digits first (then leftmost): a CVV, an expiry or another short number
    written next to a card number joins its run (`4111 1111 1111 1111 123`, `27 4111...`),
    which then fails Luhn while the card number in it passes. Each span starts with a group
    of 4 or more digits, as every card number's grouping does (4-4-4-4, 4-6-5 or unbroken),
    so a list of small numbers gains no more chances of a false match."""
    groups = [(match.start(), match.end()) for match in re.finditer(f"[^{_GAP}]+", text)]
    digits = [sum(char.isdigit() for char in text[start:end]) for start, end in groups]
    parts: list[tuple[int, int, int]] = []
    for first, (start, _) in enumerate(groups):
        if digits[first] < 4:
            continue
        total = 0
        for last in range(first, len(groups)):
            total += digits[last]
            if total >= 13 and (first, last) != (0, len(groups) - 1):
                parts.append((-total, start, groups[last][1]))
    return [(start, end) for _, start, end in sorted(parts)]


def _phone_ok(text: str) -> bool:
    digits = sum(c.isdigit() for c in text)
    return 8 <= digits <= 15


@dataclass(frozen=True)
class RedactionPass:
    name: str
    regex: str
    # Confirms a match: given the `secret` group where the pattern has one, else the match.
    validate: Callable[[str], bool] | None = None
    # The pattern is only run where one of these substrings occurs...
    needles: tuple[str, ...] = ()
    # ...or one of these in any ASCII case (found in the lower-cased text; the pattern's
    # case-blind parts are ASCII-only `(?ai:...)`, so it matches nothing these miss)...
    needles_ci: tuple[str, ...] = ()
    # ...or where this regex matches (a necessary condition). Without any of the three the
    # pattern always runs.
    needle_regex: str | None = None
    # Where `validate` rejects what it was given: the spans inside that text to validate
    # instead, best first; the first one it accepts is replaced and the rest stays.
    narrow: Callable[[str], Iterable[tuple[int, int]]] | None = None


# Passes run in this order, each on the output of the previous one, so the more specific
# formats claim a span before the generic ones (anthropic before openai, jwt before bearer,
# credit cards before phone numbers); a `[REDACTED:...]` marker matches no later pattern.
# A kind may take several passes, each with its own needle: one literal needle (`://`) is
# found far faster than an alternation of several.
# Card and phone numbers that pass their validators hold at least 8 digits, written with
# only digits, spaces, dots, dashes, parentheses and `+` between the first and last digit.
_DIGIT_RUN = rf"\d[\d{_GAP}.()+{_DASHES}]{{6,}}\d"
# A string may hold JSON text (a tool call's `arguments`, a tool result serialised as JSON),
# where a newline is the two characters `\n` and `é` may be `\u00e9`. `\b` before a token
# fails there (`n` and `9` are word characters), so `\nAKIA...` at the start of a line went
# out as it was. After a character, `_NOT_ESCAPED` says it does not end such an escape.
_NOT_ESCAPED = r"(?<!\\[nrt])(?<!\\u[0-9A-Fa-f]{4})(?<!%[0-9A-Fa-f]{2})"
# Word characters for the boundaries are ASCII: with Python's Unicode `\w`/`\b`, a key, an
# address or a card number written right after Chinese or Japanese text (no space between,
# as is usual there: `密钥是sk-...`, `邮箱bob@example.com`) had no boundary and went out as
# it was. Digits stay Unicode where numbers are read (`\d`), so a digit run inside a
# longer one is still no card or phone number.
_W = r"[A-Za-z0-9_]"
_WD = r"[A-Za-z_\d]"


def _token(first: str, rest: str, before: str = _W) -> str:
    """`first` (one character or class) then `rest`, where the character before `first` is
    not in `before` unless it ends an escape. The assertion follows `first`, so the pattern
    is only tried where `first` occurs (one that starts with an assertion is tried at every
    position of the text: several times slower)."""
    return rf"{first}(?<!{before}{_NOT_ESCAPED}{first}){rest}"


_AWS_KEY_ID = _token("A", r"(?:KIA|SIA|BIA|CCA|ROA|IDA)[0-9A-Z]{16}")
_B64 = r"[A-Za-z0-9/+]"
# A name, an optional (escaped) closing quote, `=`, `:` or `=>`, an optional opening quote:
# `name = v`, `NAME=v`, `"name": "v"`, `name='v'`, `\"name\": \"v\"`.
_ASSIGN = r"(?:\\?[\"'])?[ \t]*(?:=>|[:=])[ \t]*(?:\\?[\"'])?"
# With an upper-case letter or a digit among its first characters (looked for within a
# bound: unbounded, `sk-sk-sk-...` made every `sk-` scan the rest of the run).
_KEY_BODY = r"(?=[a-z_-]{0,40}[A-Z0-9])[A-Za-z0-9_-]{20,}"
# E-mail addresses may hold letters of any script (`josé.garcía@empresa.es`, `bob@münchen.de`);
# with ASCII-only classes such an address went out whole or all but its last ASCII run. But
# Chinese, Japanese, Thai, ... put no space around an address (`邮箱bob@example.com`), nor
# does Korean before a particle (`bob@example.com으로`), so a letter of those scripts ends a
# local part or a top-level domain as punctuation does; only a domain label, held between
# `@` and `.`, takes them (`user@例え.jp`).
_SPACELESS = (
    r"\u0e00-\u0eff\u1000-\u109f\u1100-\u11ff\u1780-\u17ff\u3040-\u30ff\u3100-\u318f"
    r"\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f"
)
# The classes are split into ASCII (a bitmap, fast) and the rest (a Unicode category, far
# slower): the email pass reads every text that holds an `@` (Python code: decorators), and
# with one class of both it ran at a third of its ASCII-only speed on code and prose (split,
# at about 60%).
_LOCAL_ASCII = r"[A-Za-z0-9._%+-]"
# A letter or digit of another script, not of those without spaces.
_LETTER_OTHER = rf"[^\x00-\x7f\W{_SPACELESS}]"
# A combining accent (`é` written as `e` and U+0301) is no `\w`, but part of its letter.
_ACCENT = r"[\u0300-\u036f]"
# In JSON text written with `ensure_ascii` such letters are escapes (`jos\u00e9`): those of
# Latin, Greek, Cyrillic, Armenian and Hebrew (U+00C0-U+05FF, the combining accents among
# them) and of Latin and Greek extended (U+1E00-U+1FFF) belong to the address there too, so
# the JSON text loses what its decoded text loses. Six characters each (a fixed width, as a
# lookbehind needs).
_ESCAPED_LETTER_HEX = r"(?:00[C-Fc-f]|0[1-5][0-9A-Fa-f]|1[EFef][0-9A-Fa-f])[0-9A-Fa-f]"
_ESCAPED_LETTER = rf"\\u{_ESCAPED_LETTER_HEX}"
# A domain label: letters and digits of any script, accents, `-`, and (held between `@` and
# `.`) any escaped non-ASCII character (`\u4f8b`).
_DOMAIN_LABEL = (
    r"(?:[A-Za-z0-9-]++|[^\x00-\x7f\W]++|[\u0300-\u036f]++|\\u(?!00[0-7])[0-9A-Fa-f]{4})++"
)
# A local part starts where no local-part character precedes it (unless that one ends an
# escape that is no letter: `\n`, `\u201c`), and never on an escape's own letter:
# `\nbob@x.io` is a newline, then `bob@x.io`; redacting from the `n` would leave
# `\[REDACTED...]`, which is not valid JSON. The pattern starts with one class that holds
# every first character (see `_token`); the lookbehinds after it reject most positions (the
# middle of a word) before anything tells which kind of character it is.
_ANY = r"(?s:.)"
_LOCAL_START = (
    rf"[A-Za-z0-9._%+\-\\\u0080-\U0010ffff](?<!{_LOCAL_ASCII}{_NOT_ESCAPED}{_ANY})"
    rf"(?<!{_LETTER_OTHER}{_ANY})(?<!{_ACCENT}{_ANY})(?<!{_ESCAPED_LETTER}{_ANY})"
    rf"(?:(?<={_LOCAL_ASCII})(?<!\\[nrt])(?!(?<=\\u)[0-9A-Fa-f]{{4}})|(?<={_LETTER_OTHER})"
    rf"|(?<=\\)u{_ESCAPED_LETTER_HEX})"
)
# The runs are possessive: none holds the `@` that must follow, so giving back is no use.
# After an ASCII run, one look at the next character tells whether another kind can follow.
_EMAIL = (
    rf"{_LOCAL_START}{_LOCAL_ASCII}*+(?:(?=[\\\u0080-\U0010ffff])"
    rf"(?:{_LETTER_OTHER}++|{_ACCENT}++|{_ESCAPED_LETTER}){_LOCAL_ASCII}*+)*+"
    rf"@{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*"
    rf"\.(?:[A-Za-z]|[^\x00-\x7f\W\d{_SPACELESS}]|{_ACCENT}|{_ESCAPED_LETTER}){{2,}}"
    rf"(?![A-Za-z0-9_]|{_LETTER_OTHER}|{_ACCENT}|{_ESCAPED_LETTER})"
)
# After `scheme://host:`, what makes the `:` a port's rather than a password's: digits or a
# placeholder (`{port}`, `${PORT}`, `$PORT`, `port`), then the path, query, fragment, a
# quote, a space or the end of the text.
_PORT = r"(?:\d*|\{\w*\}|\$\{?\w+\}?|(?ai:port))(?:[/?#\"'\s\\]|$)"
# A host that ends a URL's authority (see `url_password`): an IPv4 address, a DNS name whose
# last label starts with a letter (so no version: `1.0`, `v1.2.3`), an IPv6 literal or a
# placeholder (`${HOST}`, `{host}`), an optional port, then no more name characters.
_URL_HOST = (
    r"(?:(?:\d{1,3}\.){3}\d{1,3}|(?:[A-Za-z0-9_-]++\.)*+[A-Za-z][A-Za-z0-9_-]*+"
    r"|\[[0-9A-Fa-f:.]+\]|\$\{?\w+\}?|\{\w*\})"
    r"(?::(?:\d+|\$\{?\w+\}?|\{\w*\}))?(?![A-Za-z0-9_.~%@:-])"
)
# Query parameters that carry a credential: a password (JDBC URLs), an OAuth token or client
# secret, an API key, a signature (an Azure SAS `sig`, a presigned S3 or GCS URL).
_QUERY_CREDENTIAL = (
    r"password|passwd|pwd|access_token|refresh_token|id_token|client_secret|api_?key|token"
    r"|sig|x-amz-signature|x-amz-security-token|x-goog-signature|jsessionid"
)
# Generic secret assignments: `DB_PASSWORD=...` (env files, shell), `password: ...` (YAML,
# .ini, .properties), `"db_pass": "..."` (JSON), `client_secret = '...'` (code). Names end in
# `password`, `passwd`, `passphrase`, `secret`, `secret_key`, `secret_access_key` or `api_key`
# after any prefix (`PGPASSWORD`, `dbPassword`, `clientSecret`), or in `pass` or `pwd` after a
# `_`, `.`, `-` or a camelCase boundary (`db_pass`, `dbPwd`; never `bypass`, the keyword
# `pass` or the shell's `PWD=/home/...`). The name must end there: `PASSWORD_MIN_LENGTH=8` is
# a setting about passwords, not one, and `password_hash`, `secretName` and `secrets.X` stay.
#
# Each pass starts at a literal inside the name (`ass` of `password`, `ECRET` of `SECRET`)
# and checks the letters before it with a lookbehind: `re` finds a literal prefix with a fast
# search, where a pattern that starts with a case-blind word or a class of common letters is
# tried at almost every position (8-12 MB/s on code, against 200+ MB/s). The match starts
# inside the name, which is never replaced: only the value is.
# Each entry (`_SecretName`): the pattern from the literal on; whether the name is upper case
# (an environment variable's: see `_ENV_SECRET_VALUE`); what a closing XML tag of the name
# ends with; the needles, case-sensitive, case-blind or a regex. The needles are the name's
# last part (or a camelCase `Pass`), never `pass` alone, a keyword in most Python, nor `api`:
# a needle nearly every string of code holds would skip nothing.
#
# `token` is a word of LLM code and data as much as a secret's name: `max_tokens=256`,
# `token = tokenizer(x)`, `pad_token = "<|pad|>"` and, thousands of times in a trajectory's
# logprobs, `{"token": "Hello", "logprob": -0.1}`. A name ending in `token` (`token`,
# `auth_token`, `accessToken`, `GITHUB_TOKEN`; not `tokens`, `token_ids` or `max_tokens`,
# whose name goes on) therefore only loses a value that looks random (`_looks_random`),
# never one followed by a logprob entry's next key; nor do `publicKeyToken` (a .NET
# assembly's public hash) and pagination cursors (`page_token`, `NextToken`,
# `ContinuationToken`), which are no secrets.
_SECRET_PASS_NEEDLES = ("password", "passwd", "passphrase", "_pass", "-pass", ".pass")
_NAME_END = r"(?![A-Za-z0-9_.-])"
# What follows a token's name wherever one of its patterns matches: an assignment (`=`, `:`,
# `?=`), an XML element's `>` or attribute pair (`" value=`), and no quoted value of 15
# characters or fewer (JSON escapes count as one), which none of them takes. So a JSON text
# of logprobs (`"token": "Hello"`, thousands of times) and prose ("the token is") hold no
# needle, and `redact_obj` need not walk the object they are in.
_TOKEN_NEEDLE = (
    _NAME_END
    + r"(?!\\*[\"'][ \t]*:[ \t]*\\*[\"'](?:[^\"'\\]|\\[nrtbfu/]){0,15}\\*[\"'])"
    + r"(?:(?:\\*[\"'])?[ \t]*[=:?]|>|\\?[\"'][ \t]+(?ai:v))"
)
_LOGPROB_ENTRY = r"(?![ \t]*,[ \t]*\\*[\"'](?:logprob|bytes)\\*[\"'])"


@dataclass(frozen=True)
class _SecretName:
    """One pass of `secret_assignment`: a family of names (see above) and how to read them."""

    regex: str
    upper: bool
    tag: str
    needles: tuple[str, ...] = ()
    needles_ci: tuple[str, ...] = ()
    needle_regex: str | None = None
    # A token's name: its value is `_TOKEN_VALUE`, checked by `_looks_random`, and not a
    # logprob entry's.
    token: bool = False


_RANDOM_CHARS = re.compile(r"[A-Za-z0-9+/=_.~:-]{16,256}")
# A word of an identifier: `Service`, `token`, `HTTP`; it holds a vowel (`xqzv` is no word).
_WORD = re.compile(r"[A-Z]?[a-z]{3,}|[A-Z]{4,}(?![a-z])")
_VOWEL = re.compile(r"[aeiouyAEIOUY]")


def _wordish(value: str) -> bool:
    """Whether a value reads as words (`V1ServiceAccountTokenProjection`, `color-primary-500`,
    `awsimdsv2sessiontoken`): words cover at least 60% of its letters and digits. Random
    text rarely does (measured: about 2% of 16-20 character base62 or base64 strings, 0.2%
    of 32-character ones and of 16 hex digits, none of 32 hex digits or UUIDs)."""
    alnum = sum(c.isalnum() for c in value)
    covered = sum(len(word) for word in _WORD.findall(value) if _VOWEL.search(word))
    return covered >= 0.6 * alnum


def _looks_random(value: str) -> bool:
    """Whether a value under a `token` name is a credential: 16 or more characters of the
    alphabets tokens are written in (hex, base64, base62, a UUID), holding letters and
    digits, not words and short numbers (`_wordish`), not degenerate (Shannon entropy under
    2.5 bits per character: `aaaaaaaaaaaaaaa1`), and not vLLM's `token_id:<n>` form of a
    logprob entry's token."""
    if not _RANDOM_CHARS.fullmatch(value) or value.startswith("token_id:"):
        return False
    if not any(c.isdigit() for c in value) or not any(c.isalpha() for c in value):
        return False
    if _wordish(value):
        return False
    counts = Counter(value)
    entropy = -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())
    return entropy >= 2.5


_PASS_TAG = "(?ai:pass(?:word|wd|phrase)?)"
_SECRET_TAG = "(?ai:secret(?:[_-]?(?:access[_-]?)?key)?)"
_API_KEY_NEEDLES = ("api_key", "api-key", "apikey")
# Fixed-width lookbehinds, one per spelling.
_TOKEN_NAME_EXCLUDED = "".join(
    f"(?<!{name})"
    for name in (
        "[Pp]ublicKeyToken",
        "[Pp]age[ _-][Tt]oken",
        "[Pp]ageToken",
        "PAGE_TOKEN",
        "[Nn]ext[ _-][Tt]oken",
        "[Nn]extToken",
        "NEXT_TOKEN",
        "[Cc]ontinuationToken",
        "continuation_token",
    )
)
_SECRET_NAMES: tuple[_SecretName, ...] = (
    _SecretName(
        r"ass(?<=[Pp]ass)(?:(?ai:word|wd|phrase)|(?<=[_.-][Pp]ass)|(?<=[a-z0-9]Pass))",
        False,
        _PASS_TAG,
        ("Pass",),
        _SECRET_PASS_NEEDLES,
    ),
    _SecretName(
        r"ASS(?<=PASS)(?:WORD|WD|PHRASE|(?<=[_.-]PASS))",
        True,
        _PASS_TAG,
        needles_ci=_SECRET_PASS_NEEDLES,
    ),
    _SecretName(
        r"ecret(?<=[Ss]ecret)(?ai:[_-]?(?:access[_-]?)?key)?",
        False,
        _SECRET_TAG,
        needles_ci=("secret",),
    ),
    _SecretName(
        r"ECRET(?<=SECRET)(?:[_-]?(?:ACCESS[_-]?)?KEY)?",
        True,
        _SECRET_TAG,
        needles_ci=("secret",),
    ),
    _SecretName(
        r"wd(?:(?<=[_.-][Pp]wd)|(?<=[a-z0-9]Pwd))", False, "(?ai:pwd)", needles_ci=("pwd",)
    ),
    _SecretName(r"WD(?<=[_.-]PWD)", True, "(?ai:pwd)", needles_ci=("pwd",)),
    _SecretName(
        r"pi(?<=[Aa]pi)(?ai:[_-]?key)", False, "(?ai:api[_-]?key)", needles_ci=_API_KEY_NEEDLES
    ),
    _SecretName(r"PI(?<=API)[_-]?KEY", True, "(?ai:api[_-]?key)", needles_ci=_API_KEY_NEEDLES),
    # Needles with what follows the name (`_TOKEN_NEEDLE`): `max_tokens` and `token_ids` in
    # every request are none.
    _SecretName(
        r"oken(?<=[Tt]oken)" + _TOKEN_NAME_EXCLUDED,
        False,
        "(?ai:token)",
        needle_regex=r"oken" + _TOKEN_NEEDLE,
        token=True,
    ),
    _SecretName(
        r"OKEN(?<=TOKEN)" + _TOKEN_NAME_EXCLUDED,
        True,
        "(?ai:token)",
        needle_regex=r"OKEN" + _TOKEN_NEEDLE,
        token=True,
    ),
)
# What no value is: a placeholder or template (`${DB_PASSWORD}`, `$PASS`, `{{ secrets.X }}`,
# `{pw}`, `%s`, `%(pw)s`, `%PASSWORD%`, `<password>`, `#{pw}`), a mask (`****`, `...`) or an
# earlier pass's marker.
_PLACEHOLDER = (
    r"\$[{(A-Za-z_]|\{\{|\{%|\{\w*\}|%\(|%[sd]|%\w+%|<[^<>\s]*>|#\{|\*+(?![^*\s\"'`\\])"
    r"|\.\.\.|\[REDACTED:"
)
# An unquoted value holds no space, quote, backslash, bracket or parenthesis (those are code:
# `os.environ["X"]`, `getpass()`, `Optional[str]`), nor `,` or `;`.
_VALUE_CHAR = r"[^\s\"'`\\,;(){}\[\]<>]"
_NULLISH = rf"(?:None|none|null|NULL|Null|nil|undefined|true|false|True|False)(?!{_VALUE_CHAR})"
# Nor is it a YAML tag, anchor or alias (`!vault`, `&a`, `*a`), a pointer or a reference
# (`*p`, `&buf`), a path, a URL (a URL's password is `url_password`'s) or a dotted name
# (`self.password`, `settings.DB_PASSWORD`).
_NOT_UNQUOTED = (
    rf"(?!{_PLACEHOLDER}|{_NULLISH}|[!&*@|>~/-]|\.\.?/|[A-Za-z][A-Za-z0-9+.-]*://"
    rf"|[A-Za-z_][\w-]{{0,63}}+(?:\.[A-Za-z_][\w-]{{0,63}}+){{1,8}}+(?!{_VALUE_CHAR}))"
)
# Type names after an environment variable's name are annotations (`DB_PASSWORD: str`).
_TYPE_NAME = (
    rf"(?:str|string|String|bytes|int|bool|Any|Optional|Union|Final|ClassVar|SecretStr"
    rf"|SecretBytes|object|char)(?!{_VALUE_CHAR})"
)
# An unquoted value ends the line, the text, a shell word (`PGPASSWORD=x psql`), a statement
# (`; ...`), inline code in Markdown or the JSON string it sits in (`...\n` or `"` in a tool
# call's arguments): never at a `,` or `)`, which make `password=pw,` an argument.
_VALUE_END = r"(?=[\s;\"'`\\]|$)"
_LINE_END = r"[ \t]*(?:[\r\n#;\"'`\\]|$)"
_ASSIGN_OP = r"(?:=>|[:?]?=(?!=)|:(?!:))[ \t]*"
# After a value: not a cut-off example (`sk-...`), nor a name that ends in a secret's name
# (`apiKey = "apiKey"`, `ENV_API_KEY = "ANTHROPIC_API_KEY"`, `"my-secret"` in docs): a name
# of one, not one. (`password123` is still a value.)
_VALUE_TAIL = (
    r"(?<!\.\.\.)(?<!(?ai:password))(?<!(?ai:passwd))(?<!(?ai:secret))(?<!(?ai:secret[_-]key))"
    r"(?<!(?ai:secretkey))(?<!(?ai:api[_-]key))(?<!(?ai:apikey))"
)
_SECRET_VALUE = (
    r"(?:\\*[\"'])?[ \t]*(?:"
    # A quoted value, also after a type (`password: str = "..."`): a literal, so a secret
    # unless it is empty, a placeholder or holds a space (prose: `"Forgot password?"`).
    rf"(?:{_ASSIGN_OP}|:[ \t]*[A-Za-z_][\w.\[\], |]{{0,60}}?[ \t]*=(?!=)[ \t]*)"
    rf"(?P<q>\\*[\"'`])(?!{_PLACEHOLDER})(?P<secret>[^\s\"'`\\]{{4,256}}+){_VALUE_TAIL}(?P=q)"
    # An unquoted one only with a digit or a symbol in it: `password: hunter2x`, `s3cr3t!`;
    # a bare word is as likely a name in code (`password: str`, `password = pw`).
    rf"|{_ASSIGN_OP}{_NOT_UNQUOTED}(?=[A-Za-z_.-]{{0,255}}+(?![A-Za-z_.-]){_VALUE_CHAR})"
    # A value that ends in `:` is a key or opens a block (`"API_KEY": lambda: ...`).
    rf"(?P<secret2>{_VALUE_CHAR}{{4,256}}+)(?<!:){_VALUE_TAIL}{_VALUE_END})"
)
# An environment variable's value, whatever it is (`POSTGRES_PASSWORD=postgres`): it ends the
# line (`NAME: value` in a compose file) or is followed by a command or an option
# (`PGPASSWORD=x psql`, `docker run -e MYSQL_PASSWORD=x -d mysql`), not by more code
# (`HAS_PASS=dim < head_dim`, `PLAIN_PASSWORD: SocketOption = ...`).
_ENV_SECRET_VALUE = (
    rf"={_NOT_UNQUOTED}(?!{_TYPE_NAME})"
    rf"(?P<secret3>{_VALUE_CHAR}{{4,256}}+){_VALUE_TAIL}(?={_LINE_END}|[ \t]+(?:--?)?[A-Za-z./])"
    rf"|:[ \t]+{_NOT_UNQUOTED}(?!{_TYPE_NAME})(?P<secret4>{_VALUE_CHAR}{{4,256}}+){_VALUE_TAIL}"
    rf"(?={_LINE_END})"
)


# A plain word (`password: postgres` in YAML, `password=changeme` in a .env file or a libpq
# connection string) is taken only where code does not write one: after `: ` or right after
# `=` (no space: `password = pw` is an assignment in code as often as a line of an .ini
# file), ending the line or followed by the next `key=`, and not the last entry of an object
# or a call (`password: hashed\n}`, `password=pw\n)`: the line after closes a bracket);
# lower-case letters and `-` only (an identifier in code has a `_`, a capital or a dot:
# `password: hashedPw`, `password=user_pw`), and no type name (`password: string;`) or word
# about the value (`password: required`, `password: incorrect` in a log).
_PLAIN_STOPWORD = (
    r"(?:string|bytes|bytearray|integer|bool|boolean|number|float|unknown|object|char|text"
    r"|varchar|none|null|undefined|true|false|required|optional|hidden|masked|redacted|empty"
    r"|unset|prompt|stdin|file|default|invalid|incorrect|wrong|missing|expired|changed|reset"
    r"|saved|updated|accepted|rejected|mismatch)(?![a-z-])"
)


def _plain_word(group: str) -> str:
    return (
        rf"{_NOT_UNQUOTED}(?!{_PLAIN_STOPWORD})(?P<{group}>[a-z][a-z-]{{3,63}}+){_VALUE_TAIL}"
        rf"(?={_LINE_END}|[ \t]+[a-z_]+=)(?![ \t]*(?:\r?\n|\\n)[ \t]*[)}}\]])"
    )


_PLAIN_VALUE = rf"(?:\\*[\"'])?:[ \t]+{_plain_word('secret5')}|={_plain_word('secret6')}"
# A JSON (or Python dict) number after a quoted name: `"password": 12345678,`.
_NUMBER_VALUE = (
    r"\\*[\"'][ \t]*:[ \t]*(?P<secret7>\d{4,256}+)(?![\d.eE])"
    r"(?=[ \t]*(?:[,}\]\r\n]|\\[nr]|$))"
)
# An XML attribute pair naming the secret: `<add key="DbPassword" value="..."/>` (.NET and
# NuGet config), `<property name="password" value="..."/>` (Spring).
_ATTRIBUTE_VALUE = (
    r"\\?[\"'][ \t]+(?ai:value)[ \t]*=[ \t]*(?P<q2>\\?[\"'])"
    rf"(?!{_PLACEHOLDER}|{_NULLISH})(?P<secret9>[^\s\"'`\\<>]{{1,256}}+){_VALUE_TAIL}(?P=q2)"
)

# A token's value (before `_looks_random` reads it): 16 or more characters of the alphabets
# tokens are written in, quoted (also after a type: `token: str = "..."`) or not, and not
# cut off (`"eyJhbGci..."`: an example); a short one (`"token": "Hello"`, thousands of them
# in logprobs) fails here, before any call.
_TOKEN_CHARS = r"[A-Za-z0-9+/=_.~:-]"
_TOKEN_VALUE = (
    r"(?:\\*[\"'])?[ \t]*(?:"
    rf"(?:{_ASSIGN_OP}|:[ \t]*[A-Za-z_][\w.\[\], |]{{0,60}}?[ \t]*=(?!=)[ \t]*)"
    rf"(?P<q>\\*[\"'`])(?P<secret>{_TOKEN_CHARS}{{16,256}}+){_VALUE_TAIL}(?P=q)"
    rf"|{_ASSIGN_OP}{_NOT_UNQUOTED}(?P<secret2>{_TOKEN_CHARS}{{16,256}}+){_VALUE_TAIL}{_VALUE_END})"
)
# Between the words of a .netrc entry: spaces and line breaks (`\n` in JSON text).
_NETRC_SPACE = r"(?:[ \t]|\r?\n|\\[rn])+"


def _secret_assignment(name: _SecretName) -> str:
    """The pattern of one name's pass. A token's value is `_TOKEN_VALUE` (and must then look
    random); otherwise an environment variable's value is taken as it is, any other unquoted
    one only if it cannot be code (`_SECRET_VALUE`, `_PLAIN_VALUE`), and a JSON number too.
    For every name, an XML element's text (`<password>...</password>`, the closing tag
    ending in the same name) and an XML `value` attribute after the name."""
    if name.token:
        values = _TOKEN_VALUE
    else:
        values = rf"{_SECRET_VALUE}|{_ENV_SECRET_VALUE if name.upper else _PLAIN_VALUE}"
        values += f"|{_NUMBER_VALUE}"
    element = (
        rf">(?!{_PLACEHOLDER}|{_NULLISH})(?P<secret8>[^<>\s\"'`\\]{{1,256}}+){_VALUE_TAIL}"
        rf"</[A-Za-z0-9_.:-]{{0,64}}?{name.tag}>"
    )
    return (
        rf"{name.regex}{_NAME_END}"
        rf"(?:{values}|{element}|{_ATTRIBUTE_VALUE}){_LOGPROB_ENTRY if name.token else ''}"
    )


_BUILTIN_PASSES: tuple[RedactionPass, ...] = (
    RedactionPass(
        "private_key",
        # The whole block; without its END line (an answer cut off by max_tokens, a
        # partial paste) the BEGIN line and every base64 or header line after it. The
        # search for the END line stops at the next BEGIN line: each BEGIN without an END
        # scanned the rest of the text (quadratic in the number of BEGIN lines).
        r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
        r"(?:(?:(?!-----BEGIN )[\s\S])*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
        # Header lines (`Proc-Type: 4,ENCRYPTED`, PGP's `Comment:`) are tried first, and
        # empty lines pass: an encrypted PEM key and every PGP key has one before its body,
        # where the base64 form matched `Proc` and the search stopped, leaving the body. A
        # header's value stops at a backslash, so a JSON-escaped block stays valid JSON.
        r"|(?:(?:[ \t]*(?:\r?\n|\\n))+(?:[A-Za-z-]+:[^\r\n\\]*|[A-Za-z0-9+/=]+))*)",
        needles=("PRIVATE KEY",),
    ),
    RedactionPass(
        "jwt",
        # Signed (header.payload.signature; the signature is empty with `alg: none`) and
        # encrypted (five parts; the second is empty with `alg: dir`). It starts a run of
        # base64url characters: an `eyJ` inside one (`a-eyJa-eyJa-...`) is no token's start,
        # and trying each would scan the rest of the run once per `eyJ`.
        _token("e", r"yJ[A-Za-z0-9_-]{5,}\.", before=r"[A-Za-z0-9_-]")
        + r"(?:eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*"
        r"|[A-Za-z0-9_-]*\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,})",
        needles=("eyJ",),
    ),
    # Real key bodies are random base62/base64url and so hold an upper-case letter or a
    # digit (`_KEY_BODY`); an all-lower-case kebab/snake name (`sk-learn-model-selection-
    # helpers`, `sk-ant-design-...`) is an identifier, not a key.
    RedactionPass(
        "anthropic_key",
        _token("s", rf"k-ant-[A-Za-z0-9]{{2,10}}-{_KEY_BODY}"),
        needles=("sk-ant-",),
    ),
    RedactionPass(
        "openai_key",
        _token("s", rf"k-(?:proj-|svcacct-|admin-|None-)?{_KEY_BODY}"),
        needles=("sk-",),
    ),
    RedactionPass(
        "aws_access_key",
        # The key id, and its 40-character secret where it is recognisable: right after
        # the id (the IAM credentials CSV) or after a `secret access key` name (the
        # credentials file, env vars, boto3 arguments, STS JSON). The id alone is not
        # the credential; leaving the secret next to it would leak the part that is.
        rf"{_AWS_KEY_ID}(?!{_W})"
        rf"|{_B64}(?<={_AWS_KEY_ID}[ \t,;:|]{_B64}){_B64}{{39}}(?![A-Za-z0-9/+=])"
        rf"|(?ai:aws[_-]?secret[_-]?key|secret[_-]?access[_-]?key){_ASSIGN}"
        rf"(?P<secret>{_B64}{{40}})(?![A-Za-z0-9/+=])",
        needles=("AKIA", "ASIA", "ABIA", "ACCA", "AROA", "AIDA"),
        needles_ci=("secret",),
    ),
    RedactionPass(
        "aws_access_key",
        # The session token of temporary (STS) credentials, by the fixed start of its
        # base64 (`IQoJb3JpZ2lu...`; older ones `FwoGZXIvYXdz...`).
        _token("[IF]", r"(?:QoJb3JpZ2lu|[wQ]oGZXIvYXdz)[A-Za-z0-9/+=]{40,}"),
        needles=("IQoJb3JpZ2lu", "FwoGZXIvYXdz", "FQoGZXIvYXdz"),
    ),
    RedactionPass(
        "github_token",
        _token("g", rf"(?:h[pousr]_[A-Za-z0-9]{{36,}}|ithub_pat_[A-Za-z0-9_]{{40,}})(?!{_W})"),
        needles=("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    RedactionPass(
        "gitlab_token",  # personal, project, deploy, runner, trigger, OAuth app tokens
        _token("g", r"l(?:pat|dt|rt|ptt|cbt|oas|imt|ft|soat)-[A-Za-z0-9_-]{20,}"),
        # No `\b` in a needle: `redact_obj` searches JSON text, where the newline
        # before a token at the start of a line is `\n`, a word character before it.
        needle_regex=r"gl[a-z]{2,4}-",
    ),
    RedactionPass(
        "slack_token",  # bot/user tokens, app-level tokens, incoming-webhook URLs
        _token(
            "[xh]",
            r"(?:ox[abposre]-[A-Za-z0-9-]{10,}|app-[0-9]-[A-Za-z0-9-]{10,}"
            r"|ooks\.slack\.com/(?:services|workflows)/[A-Za-z0-9/_-]{20,})",
        ),
        needles=("xox", "xapp-", "hooks.slack.com/"),
    ),
    RedactionPass(
        "stripe_key",
        _token("[rs]", r"k_(?:live|test)_[A-Za-z0-9]{16,}"),
        needles=("k_live_", "k_test_"),
    ),
    RedactionPass(
        "huggingface_token", _token("h", rf"f_[A-Za-z0-9]{{30,}}(?!{_W})"), needles=("hf_",)
    ),
    RedactionPass("google_api_key", _token("A", r"Iza[0-9A-Za-z_-]{35}"), needles=("AIza",)),
    RedactionPass(
        "google_api_key",
        # Google OAuth credentials: access tokens, refresh tokens, client secrets.
        _token("[yG]", r"(?:a29\.[0-9A-Za-z_-]{20,}|OCSPX-[0-9A-Za-z_-]{20,})")
        + "|"
        + _token("1", r"//0[0-9A-Za-z_-]{40,}", before=r"[A-Za-z0-9_/]"),
        needles=("ya29.", "GOCSPX-", "1//0"),
    ),
    RedactionPass(
        "npm_token",
        # npm access tokens: `npm_` and 36 base62 characters (the last six a checksum).
        _token("n", rf"pm_(?=[a-z]{{0,35}}[A-Z0-9])[A-Za-z0-9]{{36}}(?!{_W})"),
        # Rare literals go in `needles_ci`: an `in` on the lowered text costs the same for any
        # needle, where each new first letter (`n`, `p`, `d`) in the one alternation of all
        # literal needles makes that search stop at more positions (about 15% slower on code).
        needles_ci=("npm_",),
    ),
    RedactionPass(
        "pypi_token",
        # PyPI and TestPyPI API tokens: `pypi-` and a base64url macaroon, whose first bytes
        # name the issuer (`AgEIcHlwaS5vcmc` holds `pypi.org`, `AgENdGVzdC5weXBpLm9yZw`
        # `test.pypi.org`). It starts a run: trying each `pypi-` inside one would scan the
        # rest of the run once per start.
        _token(
            "p",
            r"ypi-AgE(?:IcHlwaS5vcmc|NdGVzdC5weXBpLm9yZw)[A-Za-z0-9_-]{50,}",
            before=r"[A-Za-z0-9_-]",
        ),
        needles_ci=("pypi-age",),
    ),
    RedactionPass(
        "docker_hub_token",
        # Docker Hub personal (`dckr_pat_`, 27 characters) and organization (`dckr_oat_`)
        # access tokens.
        _token("d", r"ckr_(?:pat|oat)_[A-Za-z0-9_-]{24,}", before=r"[A-Za-z0-9_-]"),
        needles_ci=("dckr_",),
    ),
    RedactionPass(
        "azure_client_secret",
        # Microsoft Entra ID (Azure AD) client secrets: three characters, a digit, `Q~`, then
        # 31-34 more (`8Q~` and 34 in the current ones), as a whole word of that alphabet.
        _token(
            "[A-Za-z0-9_~.-]",
            r"[A-Za-z0-9_~.-]{2}\dQ~[A-Za-z0-9_~.-]{31,34}(?![A-Za-z0-9_~.+/=-])",
            before=r"[A-Za-z0-9_~.+/-]",
        ),
        needles_ci=("q~",),
    ),
    RedactionPass(
        "sendgrid_key",
        # `SG.`, 22 and 43 base64url characters. Under an upper-case name it is a dotted
        # value (`SENDGRID_API_KEY=SG.x.y`), which `secret_assignment` leaves alone there as
        # code (`settings.X`).
        _token("S", rf"G\.[A-Za-z0-9_-]{{22}}\.[A-Za-z0-9_-]{{43}}(?!{_W}|-)"),
        needles=("SG.",),
    ),
    RedactionPass(
        "bearer_token",
        _token("[Bb]", r"(?ai:earer)[ \t]+[A-Za-z0-9._~+/-]{16,}=*"),
        needles_ci=("bearer",),
    ),
    RedactionPass(
        "bearer_token",
        # API-key headers carry a token the same way (`X-API-Key: ...`, Azure OpenAI's
        # `api-key: ...`, GitLab's `PRIVATE-TOKEN: ...`), as a header or a JSON entry.
        _token(
            "[XxAaPp]",
            r"(?ai:(?<=x)-(?:goog-)?api-key|(?<=a)pi-key|(?<=x)-auth-token|(?<=p)rivate-token"
            r"|(?<=x)-gitlab-token)",
            before=r"[A-Za-z0-9_-]",
        )
        # A key holds a digit; an identifier (`settings.OPENAI_API_KEY`) mostly does not.
        + r"(?:\\?[\"'])?[ \t]*:[ \t]*(?:\\?[\"'])?(?=[A-Za-z._~+/-]*\d)"
        r"(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)",
        needles_ci=("api-key", "-token"),
    ),
    RedactionPass(
        "bearer_token",
        # Other token schemes of an Authorization header (`Token ...` of Django REST
        # framework and GitHub's classic tokens, `ApiKey`, `SSWS`, `sso-key`).
        r"(?ai:authorization(?:\\?[\"'])?[ \t]*[:=][ \t]*(?:\\?[\"'])?"
        r"(?:token|api-?key|key|ssws|sso-key))[ \t]+(?P<secret>[A-Za-z0-9._~+/:-]{16,}=*)",
        needles_ci=("authorization",),
    ),
    RedactionPass(
        "basic_auth",  # only after an Authorization name: "basic" is a common word
        # Quotes may be escaped (`\"authorization\": \"Basic ...\"`: nested JSON in a
        # tool's string argument), as for the AWS secret's name above.
        r"(?ai:authorization(?:\\?[\"'])?[ \t]*[:=][ \t]*(?:\\?[\"'])?basic)[ \t]+"
        r"(?P<secret>[A-Za-z0-9+/]{8,}={0,2})",
        needles_ci=("basic",),
    ),
    RedactionPass(
        "basic_auth",
        # `curl -u user:password` (a shell command in a tool call) sends Basic credentials.
        _token(
            "c",
            r"url[ \t](?:[^\n|;&]{0,256}?[ \t])?(?:-u|--user)(?:[ \t]+|=)",
            before=r"[A-Za-z0-9_-]",
        )
        + r"(?:\\?[\"'])?[^\s:\"'\\]+:(?P<secret>(?!\$)[^\s\"'\\]+)",
        needles=("curl",),
    ),
    RedactionPass(
        "url_password",  # scheme://user:password@host keeps all but the password
        # RFC 3986 reads `scheme://userinfo@host`: the authority ends at the first `/`, `?`
        # or `#`, and the userinfo at the authority's last `@`. A pasted DSN's unescaped
        # password (`p@ss#w?rd`, `a/b`, `a@b/c`) breaks that reading, and cutting it there
        # would leave the password's tail in the text; so the rule here is wider:
        # - After `user:`, unless a port follows (`host:8000/...`: an `@` later in its path
        #   or query, as in `host:8000?email=a@b.com`, is no password's), the password runs
        #   to an `@`. Its first part (up to its first `@`) may hold `/`, `?` and `#`, but no
        #   `,` or `;` after a `/` (`http://h:x/y,a@b.co` is a URL, then an address).
        # - It takes further `@` parts only when the `@` after the last of them is followed
        #   by a host that ends the authority: a DNS name whose last label starts with a
        #   letter (RFC 1123: a top-level label is never all digits), an IPv4 address, an
        #   IPv6 literal or a placeholder, with an optional port, then no more name
        #   characters. So `https://u:a@b/c@host/path` loses all of `a@b/c`, while in
        #   `https://u:pw@localhost/npm/pkg@1.0` (also `repo.git@v1.2.3`, `img@sha256:...`)
        #   the `@` is the path's: a version or a digest is no host. (A dotless host with a
        #   path that ends in `@main` or `@latest` is the case this cannot tell apart from a
        #   password; the path goes with the password there, and nothing of it leaks.)
        # - A further part may hold `?` and `#`; after its `?` or `#`, no `=` or `&` (a
        #   query: `https://u:pw@host?to=a@b.com`). It holds a `/` only after a name that is
        #   no host (no `.` or `:`) and never right before an `@`, so the `@` of
        #   `https://u:pw@registry.example.com/@scope/pkg` or `.../pkg@1.0` is the path's.
        # No part crosses a space, a `"` or an angle bracket (never valid in userinfo), so
        # `{"u":"http://host:80","to":"a@b.co"}` does not read as a password running into
        # the next JSON string; the extra `@` parts stop at a `'` too. The user part holds
        # no `[`: `http://[::1]:8000` is a host. The scheme and the first part are bounded,
        # and no part crosses a `//`, so a long text without spaces costs a bounded scan per
        # `://` (with an unbounded scheme, each letter after a `.` or `-` of `a-b.a-b...`
        # started a scan to the end of the run: 100 KB took minutes).
        rf"(?<!{_W})[A-Za-z][A-Za-z0-9+.-]{{0,31}}://[^/?#\s:@\"<>\[\]]*:"
        rf"(?!{_PORT}|\[REDACTED:\w+\]@)"
        r"(?P<secret>(?!@)[^\s@\"<>/]{0,256}(?:/[^\s@\"<>/,;]{0,256}){0,16}"
        r"(?:(?:@(?:[^/?#\s@\"'<>.:]+(?:/(?!@)[^/?#\s@\"'<>]+)+"
        r"|[^/?#\s@\"'<>]*(?:[?#][^/?#\s@\"'<>=&]*)*))+"
        rf"(?=@{_URL_HOST}))?)@",
        needles=("://",),
    ),
    RedactionPass(
        "url_password",
        # Credentials in a query (`?password=`, `&sig=`, `X-Amz-Signature=`, ...), not a
        # placeholder (`?token={token}`, `%s`, `...`). The `&` may be JSON's `\u0026` (Go's
        # encoding/json writes it so: a presigned S3 or SAS URL in a tool result).
        rf"(?:[?&;]|\\u0026)(?ai:{_QUERY_CREDENTIAL})=(?![{{$.*\[]|%s|%\()(?P<secret>[^&#;\s\"'`<>\\]+)",
        # Each name ends in one of these, `=` included.
        needles_ci=(
            "password=",
            "passwd=",
            "pwd=",
            "token=",
            "secret=",
            "apikey=",
            "api_key=",
            "sig=",
            "signature=",
            "jsessionid=",
        ),
    ),
    RedactionPass(
        "url_password",
        # The password or key of a `;`-separated connection string: ADO.NET
        # `...;Password=x;`, Azure Storage `AccountKey=...`, Service Bus `SharedAccessKey=`.
        # No spaces around the `=` and no parentheses: `;password = getpw();` is code.
        r"; ?(?ai:password|pwd)=(?P<secret>(?![{$\[])[^;\s\"'<>()\\]+)"
        + "|"
        + _token("[AS]", r"(?:ccountKey|haredAccessKey)=", before="[A-Za-z]")
        + r"(?P<secret2>[A-Za-z0-9+/%]{20,}=*)",
        needles=("AccountKey=", "SharedAccessKey="),
        needles_ci=("password=", "pwd="),
    ),
    # After the URL, query and connection-string passes, which claim their own `password=`
    # (their markers are no value here), and the vendor formats, which are more specific.
    *(
        RedactionPass(
            "secret_assignment",
            _secret_assignment(name),
            _looks_random if name.token else None,
            needles=name.needles,
            needles_ci=name.needles_ci,
            needle_regex=name.needle_regex,
        )
        for name in _SECRET_NAMES
    ),
    RedactionPass(
        "secret_assignment",
        # Values with spaces, which the passes above never take (prose: `password: "Forgot
        # your password?"`), so a pass phrase went out whole. Under a name ending in
        # `passphrase` (words by definition; any prefix or case: `wifi_passphrase`,
        # `GPG_PASSPHRASE`) any quoted value; under one ending in `password` or `passwd`, a
        # JSON pair's (`"password": "correct horse battery staple"`, a login tool's
        # arguments). Quoted only: an unquoted value's end cannot be told from the prose
        # after it.
        rf"(?:(?ai:hrase)(?<=(?ai:passphrase)){_NAME_END}(?:\\*[\"'])?[ \t]*{_ASSIGN_OP}"
        rf"(?P<q>\\*[\"'`])"
        rf"|(?:(?ai:word)(?<=(?ai:password))|(?ai:wd)(?<=(?ai:passwd)))(?P<k>\\*\")[ \t]*:[ \t]*"
        rf"(?P<q2>(?P=k)))"
        # Not a placeholder (`<your password>`), nor a label that names the secret
        # (`"forgot_password": "Forgot your password?"`).
        rf"(?!{_PLACEHOLDER}|<[^\"'`\\<>]*>\\*[\"'`])"
        rf"(?![^\"'`\\\r\n]{{0,256}}?(?ai:pass(?:word|wd|phrase)))"
        rf"(?P<secret>[^\"'`\\\r\n]{{4,256}}+){_VALUE_TAIL}(?:(?P=q)|(?P=q2))",
        needles_ci=("passphrase", "password", "passwd"),
    ),
    RedactionPass(
        "secret_assignment",
        # A .netrc entry, on one line or several: `machine <host>`, then `login` (or
        # `account`) and its value, then `password <value>`, whatever the value is (a
        # .netrc holds no code), ending the line or followed by the next keyword. The host
        # has a dot or is `localhost`, so prose ("the machine learning login page password
        # field", "login with password and ...") is no entry.
        _token(
            "m",
            rf"achine[ \t]+(?:[^\s\"'`\\]*\.[^\s\"'`\\]+|localhost)"
            rf"(?:{_NETRC_SPACE}(?:login|account)[ \t]+[^\s\"'`\\]+)*+{_NETRC_SPACE}password[ \t]+",
        )
        + rf"(?!{_PLACEHOLDER})(?P<secret>[^\s\"'`\\]{{1,256}}+)"
        + rf"(?={_NETRC_SPACE}(?:machine|login|account|macdef|default)(?!{_W})|{_LINE_END})",
        # The password passes' needles (which hold `password`): one search serves them all.
        needles_ci=_SECRET_PASS_NEEDLES,
    ),
    RedactionPass(
        "secret_assignment",
        # Passwords on a command line where the option can mean nothing else: the MySQL and
        # MariaDB clients' `-p<password>`, attached (`-p pw` prompts, and `pw` is then the
        # database; `-P 3306` is the port), `sshpass -p <password>` and `redis-cli -a
        # <password>` (or `--pass`); quoted or not, before any quoted argument (in
        # `mysql -e "... -price ..."`, `-price` is SQL).
        _token(
            "[msr]",
            r"(?:(?<=m)(?:ysql(?:dump|admin|import|show|check|slap|binlog)?"
            r"|ariadb(?:-?dump|-?admin|-?import|-?show|-?check|-?slap|-?binlog)?)"
            r"[ \t](?:[^\n|;&\"'`\\]{0,256}?[ \t])?-p"
            r"|(?<=s)shpass[ \t](?:[^\n|;&\"'`\\]{0,256}?[ \t])?-p[ \t]*"
            r"|(?<=r)edis-cli[ \t](?:[^\n|;&\"'`\\]{0,256}?[ \t])?(?:-a|--pass)[ \t]+)",
            before=r"[A-Za-z0-9_.-]",
        )
        + rf"(?:(?P<q>[\"'])(?!{_PLACEHOLDER})(?P<secret>[^\s\"'`\\]{{1,256}}+)(?P=q)"
        + rf"|(?!-|{_PLACEHOLDER})(?P<secret2>[^\s\"'`\\;|&]{{1,256}}+))",
        needles_ci=("mysql", "mariadb", "sshpass", "redis-cli"),
    ),
    RedactionPass("email", _EMAIL, needles=("@",)),
    RedactionPass(
        "email",
        # Percent-encoded, as in a URL (`?email=jane.doe%40example.com`, a URL's user part
        # `smtp://jane%40corp.com:pw@host`, a label): no `@`, so the pass above never looked.
        # The local part's run is possessive, so it may not take the `%40` itself. The
        # domain's first label has 2 characters or more: `"id%40d.log"` is a printf format.
        r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._+-](?:[A-Za-z0-9._+-]|%(?!40)[0-9A-Fa-f]{2})*+"
        r"%40[A-Za-z0-9-]{2,}(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z0-9_])",
        needles_ci=("%40",),
    ),
    RedactionPass(
        "credit_card",
        # Not touching a letter or digit on either side, nor a dash-joined one: a digit
        # run inside a hex hash or a UUID is not a card number.
        _token(
            r"\d",
            rf"(?<!{_WD}-\d)(?:[{_GAP}{_DASHES}]?\d){{12,18}}(?!{_WD}|\.\d|-{_WD})",
            before=r"[A-Za-z_\d.]",
        ),
        card_number_ok,
        needle_regex=_DIGIT_RUN,
        narrow=_card_number_parts,
    ),
    RedactionPass(
        "credit_card",
        # Right after a URL's percent escape: the pass above read `%204111...` as the run
        # `204111...`, which failed Luhn, and the card number went out as it was. A pass of
        # its own, since `%4111...%` (a SQL LIKE pattern) is a card number after a `%`.
        rf"(?<=%[0-9A-Fa-f]{{2}})\d(?<!{_WD}-\d)(?:[{_GAP}{_DASHES}]?\d){{12,18}}"
        rf"(?!{_WD}|\.\d|-{_WD})",
        card_number_ok,
        needle_regex=_DIGIT_RUN,
        narrow=_card_number_parts,
    ),
    RedactionPass(
        "phone",
        "(?:"
        + _token(
            r"\+",
            rf"\d{{1,3}}[{_GAP}.{_DASHES}]?(?:\(\d{{1,4}}\)[{_GAP}.{_DASHES}]?)?\d{{1,4}}"
            rf"(?:[{_GAP}.{_DASHES}]?\d{{2,4}}){{1,4}}",
            before=r"[A-Za-z_\d+.]",
        )
        + "|"
        + _token(
            r"\(",
            rf"\d{{3}}\)[{_GAP}.{_DASHES}]?\d{{3}}[{_GAP}.{_DASHES}]\d{{4}}",
            before=r"[A-Za-z_\d+.]",
        )
        + "|"
        + _token(r"\d", r"\d{2}[.-]\d{3}[.-]\d{4}", before=r"[A-Za-z_\d+.]")
        + rf")(?!{_WD}|\.\d)",
        _phone_ok,
        needle_regex=_DIGIT_RUN,
    ),
)
BUILTIN_PASSES_BY_KIND: dict[str, list[RedactionPass]] = {}
for _pass in _BUILTIN_PASSES:
    BUILTIN_PASSES_BY_KIND.setdefault(_pass.name, []).append(_pass)
assert tuple(BUILTIN_PASSES_BY_KIND) == BUILTIN_REDACTION_KINDS
MIN_BUILTIN_LENGTH = 6  # the shortest text any built-in kind matches
