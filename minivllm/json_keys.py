"""Chapter 11: no key twice in one JSON object, which a grammar cannot say.

A context-free grammar can require properties a schema names, each once and in order, but an
object whose keys are free (`json_object`, or a schema's `{"type": "object"}` with no properties)
is `{ string : value (, string : value)* }`: "a key not seen before in this object" is not
context-free. So beside the grammar's mask this guard follows the text byte by byte, keeps each
open object's keys, and, while a key is being written, forbids every token that would close it
as one already there. Only tokens holding a `"` can close a key: they are listed once per
vocabulary, and a step inside a key checks only them.
"""

from __future__ import annotations

import json

QUOTE, BACKSLASH = ord('"'), ord("\\")


class _State:
    """Where the text stands: the open containers ([keys] for an object, None for an array),
    inside a string or not, and the raw bytes of the key being written (None: not in a key)."""

    def __init__(self):
        self.stack: list[set | None] = []
        self.expect_key = False      # the next string of the innermost object is a key
        self.in_string = self.escape = False
        self.key: bytearray | None = None

    def copy(self) -> "_State":
        s = _State()
        s.stack = [keys if keys is None else set(keys) for keys in self.stack]
        s.expect_key, s.in_string, s.escape = self.expect_key, self.in_string, self.escape
        s.key = None if self.key is None else bytearray(self.key)
        return s

    def feed(self, data: bytes) -> None:
        for c in data:
            if self.in_string:
                if self.escape or c == BACKSLASH:
                    self.escape = not self.escape
                elif c == QUOTE:
                    self.in_string = False
                    if self.key is not None:
                        self.stack[-1].add(key_text(bytes(self.key)))
                        self.key, self.expect_key = None, False
                    continue
                if self.key is not None:
                    self.key.append(c)
            elif c == QUOTE:
                self.in_string = True
                in_object = bool(self.stack) and self.stack[-1] is not None
                self.key = bytearray() if in_object and self.expect_key else None
            elif c in b"{[":
                self.stack.append(set() if c == ord("{") else None)
                self.expect_key = c == ord("{")
            elif c in b"}]" and self.stack:
                self.stack.pop()
                self.expect_key = False
            elif c == ord(",") and self.stack and self.stack[-1] is not None:
                self.expect_key = True


def key_text(raw: bytes) -> str:
    """A key as JSON reads it: "\\u0061" and "a" are the same key."""
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw.decode("utf-8", "replace")


def quote_tokens(decoded_vocab: list[bytes]) -> list[tuple[int, bytes]]:
    """(id, bytes) of every token holding a `"`: the only ones that can close a key."""
    return [(i, b) for i, b in enumerate(decoded_vocab) if QUOTE in b]


# --8<-- [start:guard]
class KeyGuard:
    """One request's guard: `accept` each token's bytes, `banned` the tokens that would repeat a key."""

    def __init__(self, quoted: list[tuple[int, bytes]], token_bytes):
        self.quoted, self.token_bytes = quoted, token_bytes
        self.states = [_State()]     # one per accepted token, for rollback (speculative decoding)

    def accept(self, token: int) -> None:
        state = self.states[-1].copy()
        state.feed(self.token_bytes(token))
        self.states.append(state)

    def rollback(self, n: int) -> None:
        del self.states[len(self.states) - n:]

    def banned(self) -> list[int]:
        state = self.states[-1]
        if state.key is None or not state.stack[-1]:
            return []                 # not writing a key, or the first key of its object
        seen, out = state.stack[-1], []
        for token, data in self.quoted:
            raw, escape = bytearray(state.key), state.escape
            for c in data:
                if not escape and c == QUOTE:
                    if key_text(bytes(raw)) in seen:
                        out.append(token)
                    break
                escape = not escape and c == BACKSLASH
                raw.append(c)
        return out
# --8<-- [end:guard]
