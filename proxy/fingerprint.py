"""A stream's `system_fingerprint`, carried from the usage chunk the proxy drops to the
finish chunks where vLLM would have put it.

vLLM (0.32) stamps a stream's fingerprint on its finish chunks when no usage chunk follows,
and on the usage chunk alone when one does ("the true final message"). The proxy asks for
the usage chunk on its own behalf and drops it, so a client that asked for none lost the
fingerprint its direct stream carries. A read's finish events are therefore held until the
next read: when that read (or the same one) brings the usage chunk, they go out stamped as
vLLM stamps them, the fingerprint as the chunk's last key. vLLM sends the usage chunk right
after the last finish chunk, so the hold costs the stream no time; the relay waits for that
read a second at most (`completions.FINISH_HOLD_S`), then writes the held chunk as it is.
With `n > 1` the choices finishing together (their finish chunks in consecutive reads) wait
together; a choice that finished while another goes on is sent unstamped with the other's
next chunk: held longer, it would hold the other choice's text until the end.

Written on the bytes: in JSON a `"` inside a string is escaped, so `"finish_reason":"` and
`"system_fingerprint":"` can only be keys (the same proof `relay.strip_bytes` rests on).
"""

from __future__ import annotations

import re

_FINISH = b'"finish_reason":"'  # a finish reason that is set (a string, not null)
_STAMPED = b'"system_fingerprint":"'
_FINGERPRINT = re.compile(rb'"system_fingerprint":("(?:[^"\\]|\\.)*")')
_DONE_EVENT = b"data: [DONE]\n\n"


class FingerprintCarry:
    """One stream's held finish events; `pass_on` for each read, `flush` at its end."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = b""

    def pass_on(self, block: bytes, out: bytes) -> bytes:
        """The bytes to write now, given a read's whole upstream events (`block`) and what
        the relay made of them for the client (`out`)."""
        held = self._held
        if held:
            self._held = b""
            out = held + out
        elif _FINISH not in out:
            return out  # the usual read: one search
        found = _FINGERPRINT.search(block) if _STAMPED in block else None
        if found is not None:
            return _stamp(out, found.group(1))
        at = out.find(_FINISH, len(held))
        if at < 0 or out.endswith(_DONE_EVENT):
            return out
        border = out.rfind(b"\n\n", 0, at)
        start = border + 2 if border >= 0 else 0
        if start == len(held):
            start = 0  # the read brought finish events only (the choices of `n > 1`): all wait
        self._held = out[start:]
        return out[:start]

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def flush(self) -> bytes:
        """What is still held: the stream ended or failed before its next read."""
        held, self._held = self._held, b""
        return held


def _stamp(out: bytes, fingerprint: bytes) -> bytes:
    """`out` with `,"system_fingerprint":<fingerprint>` closing each finish event without one."""
    pieces = []
    start = 0
    at = out.find(_FINISH)
    while at >= 0:
        end = out.find(b"\n\n", at)
        if end < 0:
            break
        brace = out.rfind(b"}", at, end)
        if brace >= 0 and _STAMPED not in out[at:end]:
            pieces += [out[start:brace], b',"system_fingerprint":', fingerprint]
            start = brace
        at = out.find(_FINISH, end)
    pieces.append(out[start:])
    return b"".join(pieces)
