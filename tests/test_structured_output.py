"""Chapter 11: constrained decoding. Even a random model, constrained, only writes valid output."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import jsonschema
import pytest

from conftest import load_script
from minivllm import LLM
from minivllm.output import constrain, sample
from minivllm.structured import StructuredOutput, make_constraint
from minivllm.text import render_chat

BUDGET = 160
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"]},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                              "ok": {"type": "boolean"}}, "required": ["colour", "ok"]},
    "ranges": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                "score": {"type": "integer", "minimum": -5, "maximum": 5}},
               "required": ["age", "score"]},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "note": {"type": "string", "maxLength": 5}},
                 "required": ["id"]},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 5}, {"type": "null"}]}},
        "required": ["value"]},
}
PROMPTS = ["Give me JSON.", "The weather today is", "List three colours:"]


@pytest.fixture(scope="module")
def contracts():
    return load_script("03_contracts")


@pytest.fixture(scope="module")
def so():
    return load_script("15_structured_output")


@pytest.fixture(scope="module")
def tiny_model_engine(tiny_model_dir):
    return load_script("10_model_engine").ModelEngine(str(tiny_model_dir), device="cpu",
                                                      structured_output=StructuredOutput())


@pytest.fixture(scope="module")
def tiny_cb(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu")


def structured(contracts, schema, **kw):
    return contracts.SamplingParams(structured={"json_schema": schema}, **kw)


def assert_valid(result, schema):
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


# --- SamplingParams.structured ---------------------------------------------------------------

def test_structured_is_a_hashable_checked_pair(contracts):
    P = contracts.SamplingParams
    a = P(structured={"json_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}})
    b = P(structured={"json_schema": '{"type": "object",  "properties": {"x": {"type": "integer"}}}'})
    assert a == b and hash(a) == hash(b) and a.structured[0] == "json_schema"   # compact JSON text
    assert dataclasses.replace(a, temperature=0.5).structured == a.structured
    assert copy.deepcopy(a) == a
    assert P(structured={"choice": ["yes", "no"]}).structured == ("choice", ("yes", "no"))
    assert P(structured={"json_object": True}).structured == ("json_object", "")
    assert P(structured={"regex": r"\d{3}"}).structured == ("regex", r"\d{3}")
    assert P(structured={"grammar": 'root ::= "a" | "b"'}).structured[0] == "grammar"
    assert P().structured is None


@pytest.mark.parametrize("bad, words", [
    ({"json_schema": {"type": "nonsense"}}, "does not compile"),
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "must be a JSON object"),
    ({"json_schema": json.loads('{"a":' * 17 + "{}" + "}" * 17)}, "nested deeper"),
    ({"json_schema": {"type": "object", "description": "x" * 40_000}}, "at most"),
    ({"regex": "a("}, "does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "does not compile"),
    ({"choice": []}, "non-empty list"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": ["x"] * 65}, "1 to 64"),
    ({"choice": [""]}, "non-empty strings"),
    ({"json_object": False}, "must be True"),
    ({"regex": ""}, "non-empty string"),
    ({"xml": "<a/>"}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ("json", "must be a dict"),
])
def test_bad_constraints_are_refused_naming_the_problem(contracts, so, tiny_model_engine, bad, words):
    """Its shape is SamplingParams' to check; whether it parses, the grammar library's: the feature
    says so when asked, and an engine when the request arrives."""
    with pytest.raises(ValueError, match=f"^structured.*{re.escape(words)}"):
        so.StructuredOutput().check(contracts.SamplingParams(structured=bad).structured)
    with pytest.raises(ValueError, match=f"^structured.*{re.escape(words)}"):
        tiny_model_engine.generate("Hi", 4, contracts.SamplingParams(structured=bad))


def test_an_engine_built_without_the_feature_says_so(contracts, tiny_model_dir):
    engine = load_script("10_model_engine").ModelEngine(str(tiny_model_dir), device="cpu")
    with pytest.raises(ValueError, match="built without structured output"):
        engine.generate("Hi", 4, contracts.SamplingParams(structured={"choice": ["yes", "no"]}))


# --- the idea by hand, and the constraint's interface ----------------------------------------

def test_by_hand_allows_the_same_tokens_as_xgrammar(so, tiny_model_engine):
    tok, eos = tiny_model_engine.tokenizer, tiny_model_engine.output.eos_token_ids
    vocab = tiny_model_engine.output.vocab_size
    choices = ["positive", "negative", "neutral"]
    by_hand = so.ChoiceByHand(choices, so.token_texts(tok), eos)
    real = make_constraint(tok, vocab, eos, ("choice", tuple(choices)))
    for token in tok("neutral", add_special_tokens=False).input_ids + [min(eos)]:
        hand_allowed = {t for t in range(vocab) if by_hand.allowed(t)}
        assert hand_allowed == set(real.allowed_mask().nonzero().flatten().tolist())
        assert by_hand.accept(token) and real.accept(token)
    assert by_hand.finished and real.finished and by_hand.text == "neutral"


def test_constraint_allows_accepts_and_rolls_back(tiny_model_engine):
    tok, eos = tiny_model_engine.tokenizer, tiny_model_engine.output.eos_token_ids
    c = make_constraint(tok, tiny_model_engine.output.vocab_size, eos, ("regex", "ab+c"))
    a, b, cc = (tok.convert_tokens_to_ids(x) for x in "abc")
    assert c.allowed(a) and not c.allowed(b)
    assert c.accept(a) and c.accept(b) and c.accept(b)
    assert c.allowed(cc) and not c.finished
    assert not c.accept(a)                  # refused, and nothing changes
    c.rollback(2)                           # back to "a": b is needed again
    assert c.allowed(b) and not c.allowed(cc)
    assert c.accept(b) and c.accept(cc) and c.accept(min(eos)) and c.finished


# --- every constrained output parses and validates -------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "seeded"])
def test_constrained_output_validates(contracts, tiny_model_engine, name, sampling):
    schema = SCHEMAS[name]
    for prompt in PROMPTS:
        assert_valid(tiny_model_engine.generate(prompt, BUDGET, structured(contracts, schema, **sampling)), schema)


def test_other_kinds_match_their_language(contracts, tiny_model_engine):
    P, gen = contracts.SamplingParams, tiny_model_engine.generate
    assert gen("Pick:", 16, P(structured={"choice": ["alpha", "beta"]})).text in ("alpha", "beta")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", gen("Code:", 16, P(structured={"regex": "[0-9]{3}-[a-z]{2}"})).text)
    assert gen("Say:", 16, P(structured={"grammar": 'root ::= "yes" | "no" | "maybe"'})).text in ("yes", "no", "maybe")
    result = gen("JSON:", BUDGET, P(structured={"json_object": True}, temperature=1.0, seed=1, top_k=3))
    assert result.finish_reason == "length" or isinstance(json.loads(result.text), dict)


def test_the_grammar_ends_a_request_even_with_ignore_eos(contracts, tiny_model_engine, tiny_engine):
    params = contracts.SamplingParams(structured={"choice": ["alpha", "beta"]}, ignore_eos=True)
    for engine in (tiny_model_engine, tiny_engine):
        result = engine.generate("Pick:", 32, params)
        assert result.finish_reason == "stop" and result.text in ("alpha", "beta")


def test_every_engine_gives_the_same_constrained_tokens(contracts, tiny_model_dir, tiny_engine, tiny_model_engine):
    """Chapter 1 (HF generate with a logits processor), 2 (our loop) and 6 (our model): token for token."""
    params = structured(contracts, SCHEMAS["nested"])
    loop = load_script("07_decode_loop").DecodeLoopEngine(str(tiny_model_dir), device="cpu", structured_output=StructuredOutput())
    results = [e.generate(PROMPTS[0], BUDGET, params) for e in (tiny_engine, loop, tiny_model_engine)]
    assert results[0].output_ids == results[1].output_ids == results[2].output_ids
    assert_valid(results[0], SCHEMAS["nested"])
    stream = list(tiny_engine.generate_stream(PROMPTS[0], BUDGET, params))
    assert stream[-1].output_ids == results[0].output_ids


def test_sample_masks_constrained_rows_only(contracts, tiny_model_engine):
    import torch

    out, P = tiny_model_engine.output, contracts.SamplingParams
    requests = [out.new_request([1, 2, 3], P(), 8), out.new_request([1, 2], P(structured={"choice": ["yes", "no"]}), 8),
                out.new_request([4], P(temperature=1.0, seed=1), 8)]
    logits = torch.randn(3, out.vocab_size)
    before = logits.clone()
    masked = constrain(logits, requests)
    assert torch.equal(logits, before)                       # the raw logits are not touched (logprobs read them)
    assert torch.equal(masked[0], before[0]) and torch.equal(masked[2], before[2])   # free rows: bit for bit
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < 20 and all("yes".startswith(t) or "no".startswith(t)
                                         for t in out.tokenizer.batch_decode([[a] for a in allowed]))
    token = sample(logits, requests)[1]
    assert token in allowed


def test_one_bitmask_a_step_for_every_constrained_row(contracts, so, tiny_model_engine):
    """constrain() hands every constrained row's grammar the same CPU bitmask, one row each, and
    masks the logits from it in one go: the same -inf as each constraint's own mask, bit for bit,
    for xgrammar and for the by-hand scan alike."""
    import torch

    out, P = tiny_model_engine.output, contracts.SamplingParams
    requests = [out.new_request([1, 2], P(structured={"choice": ["yes", "no"]}), 8), out.new_request([1, 2, 3], P(), 8),
                out.new_request([4], P(structured={"regex": "[0-9]+"}), 8), out.new_request([5], P(), 8)]
    by_hand = so.ChoiceByHand(["alpha", "beta"], so.token_texts(out.tokenizer), out.eos_token_ids)
    requests[3].constraint = by_hand
    seen = []
    for r in requests:
        if r.constraint is not None:
            fill = r.constraint.fill_bitmask
            r.constraint.fill_bitmask = lambda words, row, fill=fill: seen.append((words, row)) or fill(words, row)
    logits = torch.randn(4, out.vocab_size)
    masked = constrain(logits, requests)
    assert [row for _, row in seen] == [0, 1, 2] and all(words is seen[0][0] for words, _ in seen)
    assert seen[0][0].device.type == "cpu" and seen[0][0].shape == (3, -(-out.vocab_size // 32))
    assert torch.equal(masked[1], logits[1])
    for i in (0, 2, 3):
        alone = logits[i].clone()
        requests[i].constraint.mask(alone)
        assert torch.equal(masked[i], alone)


def test_bits_pack_and_unpack():
    import torch
    from minivllm.output import pack_bits, unpack_bits

    keep = torch.rand(100) < 0.5
    keep[31] = keep[63] = True        # the sign bit of a word
    words = pack_bits(keep)
    assert words.dtype == torch.int32 and words.shape == (4,)
    assert torch.equal(unpack_bits(words.view(1, -1), 100)[0], keep)


def test_static_batch_constrains_every_row(contracts, tiny_model_dir):
    engine = load_script("09_static_batching").StaticBatchEngine(str(tiny_model_dir), device="cpu", structured_output=StructuredOutput())
    P = contracts.SamplingParams
    free = engine.generate_batch(PROMPTS, 24, P())
    forced = engine.generate_batch(PROMPTS, BUDGET, structured(contracts, SCHEMAS["enum"]))
    for r in forced:
        assert_valid(r, SCHEMAS["enum"])
    assert [r.output_ids for r in free] == [r.output_ids for r in engine.generate_batch(PROMPTS, 24, P())]


def test_continuous_batching_mixed_step_leaves_free_requests_alone(contracts, tiny_cb):
    """Constrained and free requests in the same steps: the free ones come out as they do alone."""
    P = contracts.SamplingParams
    free_params = [P(), P(temperature=1.0, seed=5), P(logprobs=2)]
    alone = [tiny_cb.generate(p, 40, fp) for p, fp in zip(PROMPTS, free_params)]
    jobs = [tiny_cb.new_request(p, 40, fp) for p, fp in zip(PROMPTS, free_params)]
    names = sorted(SCHEMAS)
    jobs += [tiny_cb.new_request(PROMPTS[i % 3], BUDGET, structured(contracts, SCHEMAS[n], temperature=0.7, seed=i))
             for i, n in enumerate(names)]
    results = [list(s)[-1] for s in tiny_cb.submit_all(jobs)]
    for a, b in zip(alone, results[:3]):   # the same tokens; logprobs' last bits follow the batch's shape
        assert (a.output_ids, a.text) == (b.output_ids, b.text)
    assert [e.token_id for e in alone[2].logprobs] == [e.token_id for e in results[2].logprobs]
    assert [e.logprob for e in alone[2].logprobs] == pytest.approx([e.logprob for e in results[2].logprobs], abs=1e-4)
    for name, result in zip(names, results[3:]):
        assert_valid(result, SCHEMAS[name])
    solo = tiny_cb.generate(PROMPTS[0], BUDGET, structured(contracts, SCHEMAS[names[0]], temperature=0.7, seed=0))
    assert solo.output_ids == results[3].output_ids


@pytest.mark.real_model
def test_real_model_json_always_validates_where_free_text_does_not(contracts, default_model_dir):
    engine = load_script("10_model_engine").ModelEngine(str(default_model_dir), device="cpu", structured_output=StructuredOutput())
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "number"}},
              "required": ["city", "population_millions"]}
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content":
                                             "Describe Paris as JSON with the keys city and population_millions."}])
    assert_valid(engine.generate(prompt, 64, structured(contracts, schema)), schema)
