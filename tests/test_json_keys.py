"""Chapter 11's key guard: no key twice in one JSON object, in json_object and schema modes."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from minivllm.json_keys import KeyGuard, quote_tokens
from minivllm.structured import make_constraint, token_bytes


def test_the_guard_forbids_closing_a_key_already_in_its_object():
    vocab = [b'{"', b'a', b'"', b'a"', b'b"', b': 1, "', b'}', b'\\u0061"', b'": {"', b'}, "', b', "', b'b']
    guard = KeyGuard(quote_tokens(vocab), vocab.__getitem__)
    ids = {v: i for i, v in enumerate(vocab)}
    for piece in (b'{"', b'a"', b': 1, "'):         # {"a": 1, "
        guard.accept(ids[piece])
    assert set(guard.banned()) == {ids[b'a"'], ids[b'\\u0061"']}   # "a" again, however it is spelt
    guard.accept(ids[b'b"'])                       # {"a": 1, "b"
    assert guard.banned() == []                     # writing a value now, not a key
    guard.rollback(1)
    assert ids[b'a"'] in guard.banned()
    guard.accept(ids[b'b']), guard.accept(ids[b'": {"'])   # {"a": 1, "b": {"  a new object: "a" is free there
    assert guard.banned() == []
    guard.accept(ids[b'a"']), guard.accept(ids[b': 1, "'])
    assert ids[b'a"'] in guard.banned()             # {"a": 1, "b": {"a": 1, "   but not twice in it


@pytest.fixture(scope="module")
def tok(default_model_dir):   # one tokenizer: the vocabulary is read once for every grammar
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("spec", [("json_object", ""),
                                  ("json_schema", json.dumps({"type": "object"})),
                                  ("json_schema", json.dumps({"type": "object", "properties": {
                                      "x": {"type": "object"}}, "required": ["x"], "additionalProperties": False}))])
def test_a_constraint_never_lets_an_object_repeat_a_key(tok, spec):
    c = make_constraint(tok, len(tok), {tok.eos_token_id}, spec)
    prefix = '{"x": {"k": 1, "k' if "properties" in spec[1] else '{"k": 1, "k'
    for t in tok.encode(prefix, add_special_tokens=False):
        assert c.accept(t), (prefix, tok.decode([t]))
    vocab, _ = token_bytes(tok, len(tok), (tok.eos_token_id,))
    allowed = c.allowed_mask()
    closers = [t for t in range(len(vocab)) if vocab[t].startswith(b'"')]
    assert closers and not any(allowed[t] for t in closers)   # "k" again: no token may close it
    assert allowed[tok.convert_tokens_to_ids("2")]            # "k2" is another key
