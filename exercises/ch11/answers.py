"""Chapter 11 exercises: structured output (minivllm/structured.py, minivllm/output.py) (your answers)."""

# Write your answers in this file, then check them: pytest exercises/ch11
# (the shipped solutions are in solutions/answers.py: try first)

import json


# Exercise 11.1 (predict, then measure). The constraint {"choice": ["yes", "no"]} on SmolLM2's
# tokenizer, before any token: how many tokens does its bitmask allow
# (make_constraint(...).allowed_mask().sum())? Tolerance: exact.
CHOICE_FIRST_TOKENS = None


def unique_items_errors(text: str, schema: dict) -> list[str]:
    """Exercise 11.2 (extend): xgrammar's JSON-schema grammar does not enforce "uniqueItems", so
    check it after decoding. Return one message per array in the decoded JSON `text` whose schema
    says "uniqueItems": true and that holds two equal items (nested objects' "properties" and
    arrays' "items" included); [] when all is well. Checked on hand-made cases."""
    raise NotImplementedError


def check_digits_only(engine) -> None:
    """Exercise 11.3 (find the bug): raise AssertionError unless this LLM, asked for
    {"regex": "[0-9]{4}"}, answers four digits, greedy and sampled. Called on the real engine
    and on one with a defect planted in how the grammar's bitmask meets the logits."""
    raise NotImplementedError
