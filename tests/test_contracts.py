"""03_contracts.py: validation, defaults and the JSON view of metrics."""

import pytest

from conftest import REPO_ROOT
from minivllm.contracts import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_TEMPERATURE, REPETITION_RANGE, GenerateResult,
                                RequestMetrics, SamplingParams)


def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.is_greedy
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.stop) == (0.0, 1.0, 0, None, ())
    assert not SamplingParams(temperature=0.7).is_greedy


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": None}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": float("nan")}, "max_tokens"),
    ({"logprobs": True}, "logprobs"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": None}, "stop"),       # logits / 1e-300 overflow float32: NaN probabilities
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 0.009}, "repetition_penalty"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ("ok", "")}, "stop"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ("a",) * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1)
    SamplingParams(top_p=1e-6)
    SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=REPETITION_RANGE[0])
    SamplingParams(seed=2**64 - 1, stop=("x" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS)


def test_stop_accepts_a_single_string_or_a_list():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_token_budget_is_capped_by_max_tokens():
    assert SamplingParams().token_budget(50) == 50
    assert SamplingParams(max_tokens=10).token_budget(50) == 10
    assert SamplingParams(max_tokens=100).token_budget(50) == 50
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams().token_budget(0)


def test_as_dict_includes_optional_metrics_only_when_measured():
    bare = RequestMetrics(throughput=10.0, input_tokens=5, output_tokens=7)
    assert bare.as_dict() == {"throughput": 10.0, "input_tokens": 5, "output_tokens": 7}
    full = RequestMetrics(10.0, 5, 7, ttft_ms=12.5, tpot_ms=3.0)
    assert full.as_dict() == {"throughput": 10.0, "input_tokens": 5, "output_tokens": 7,
                              "ttft_ms": 12.5, "tpot_ms": 3.0}
    assert RequestMetrics(10.0, 5, 7, ttft_ms=0.0).as_dict()["ttft_ms"] == 0.0  # zero is a measurement


def test_generate_result_checks_finish_reason():
    metrics = RequestMetrics(1.0, 1, 1)
    assert GenerateResult("x", [1], metrics).finish_reason == "length"
    assert GenerateResult("x", [1], metrics, finish_reason="stop").finish_reason == "stop"
    with pytest.raises(ValueError, match="finish_reason"):
        GenerateResult("x", [1], metrics, finish_reason="eos")


def test_contracts_do_not_import_torch():
    source = (REPO_ROOT / "03_contracts.py").read_text()
    assert "import torch" not in source
