"""Chapter 11 exercises: structured output (minivllm/structured.py, minivllm/output.py) (solutions)."""

import json


# Exercise 11.1 (predict, then measure). The constraint {"choice": ["yes", "no"]} on SmolLM2's
# tokenizer, before any token: how many tokens does its bitmask allow
# (make_constraint(...).allowed_mask().sum())? Tolerance: exact.
# why: every token that starts one of the answers and stays inside it: "y", "ye", "yes", "n", "no".
CHOICE_FIRST_TOKENS = 5


def unique_items_errors(text: str, schema: dict) -> list[str]:
    """Exercise 11.2 (extend): xgrammar's JSON-schema grammar does not enforce "uniqueItems", so
    check it after decoding. Return one message per array in the decoded JSON `text` whose schema
    says "uniqueItems": true and that holds two equal items (nested objects' "properties" and
    arrays' "items" included); [] when all is well. Checked on hand-made cases."""
    errors = []

    def walk(value, node, where):
        if isinstance(value, list):
            if node.get("uniqueItems"):
                seen = [json.dumps(v, sort_keys=True) for v in value]
                if len(set(seen)) < len(seen):
                    errors.append(f"{where}: items are not unique")
            for i, v in enumerate(value):
                walk(v, node.get("items", {}), f"{where}[{i}]")
        elif isinstance(value, dict):
            for key, v in value.items():
                walk(v, node.get("properties", {}).get(key, {}), f"{where}.{key}")

    walk(json.loads(text), schema, "$")
    return errors


def check_digits_only(engine) -> None:
    """Exercise 11.3 (find the bug): raise AssertionError unless this LLM, asked for
    {"regex": "[0-9]{4}"}, answers four digits, greedy and sampled. Called on the real engine
    and on one with a defect planted in how the grammar's bitmask meets the logits."""
    import re

    from minivllm.contracts import SamplingParams
    for params in (SamplingParams(structured={"regex": "[0-9]{4}"}),
                   SamplingParams(structured={"regex": "[0-9]{4}"}, temperature=1.0, seed=1)):
        try:
            text = engine.generate("Pick a year:", 8, params).text
        except RuntimeError as exc:   # the output processor refuses a token the grammar forbids
            raise AssertionError(f"the engine produced a forbidden token: {exc}") from None
        assert re.fullmatch(r"[0-9]{4}", text), f"not four digits: {text!r}"
