"""The options table (minivllm/config.py): each engine option once, and every entry point reads it.

`LLM`'s keywords, the server's flags and both benchmarks' flags must carry every option of the
table with its default and its bounds; every weight format the package has must be accepted.
A new option that misses one of them fails here, by name.
"""

import argparse
import ast
import inspect
import math

import pytest

from conftest import REPO_ROOT, parser_of
from minivllm import LLM
from minivllm.config import MAX_SEQS, EngineConfig, check_option
from minivllm.engine import LLMEngine
from minivllm.quantization import MODES, WeightFormat
from minivllm.scheduler import Scheduler
from minivllm.block_manager import BlockManager

TABLE = EngineConfig.table()
CHAPTER_ONE = ("model", "device", "dtype")          # every engine's, not options of the assembled one
PARTS = ("structured_output", "vllm_spelling")     # a collaborator handed in; vLLM's spellings of the rows


ENTRY_POINTS = ("05_server", "06_benchmark_offline", "06_benchmark_online")


def test_every_option_is_a_keyword_of_llm_with_the_tables_default():
    params = inspect.signature(LLM).parameters
    options = [name for name in params if name not in CHAPTER_ONE + PARTS]
    assert options == list(TABLE), "LLM's option keywords must be the table's, in its order"
    for name, (default, _) in TABLE.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default, f"LLM({name}=...) defaults to {params[name].default!r}, " \
                                                f"the table to {default!r}"
    assert all(name in (inspect.getdoc(LLM.__init__) or "") or name in str(inspect.signature(LLM))
               for name in TABLE)   # help(LLM) lists them


def test_the_config_is_built_by_keyword_only():
    with pytest.raises(TypeError):
        EngineConfig(None, 16)   # positional: two swapped budgets would pass every check


def values_around(row):
    """(accepted, refused) values of one row, as the command line writes them."""
    if row.kind == "int":
        return [str(row.low), str(row.high)], [str(row.low - 1), str(row.high + 1), "1.5"]
    if row.kind == "bytes":
        return ["1", "512MB", "1TB"], ["0", "2TB", "lots"]
    if row.kind == "fraction":
        return ["0.5", "1"], ["0", "1.01", "nan"]
    if row.kind == "choice":
        return [str(c) for c in row.choices], ["not-a-choice", "0"]
    return [], []


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_option_is_a_flag_with_the_tables_bounds(script, monkeypatch):
    parser = parser_of(script, monkeypatch)
    actions = {a.dest: a for a in parser._actions}
    for name, (default, row) in TABLE.items():
        name_here = "engine_" + name if "engine_" + name in actions else name   # beside a script's own --seed
        assert name_here in actions, f"{script} has no --{name.replace('_', '-')}"
        action = actions[name_here]
        assert action.default is None, f"--{name}: left out, the engine's own default must apply"
        assert f"Chapter {row.chapter}" in action.help and (default is None or row.kind in ("flag", "switch")
                                                              or f"default {default}" in action.help), name
        if row.kind in ("flag", "switch"):
            assert action.nargs == 0 and action.const is True, name
            continue
        accepted, refused = values_around(row)
        for text in accepted:   # what the flag takes, the table takes
            converted = action.type(text) if action.type else text
            assert action.choices is None or converted in action.choices, (name, text)
            check_option(name, converted)
        for text in refused:
            with pytest.raises((argparse.ArgumentTypeError, ValueError, AssertionError)):
                converted = action.type(text) if action.type else text
                assert action.choices is None or converted in action.choices
            if row.kind in ("int", "bytes", "fraction") and _number(text) is not None:
                with pytest.raises(ValueError, match=name):
                    check_option(name, _number(text))


def _number(text: str):
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else value


def test_the_table_refuses_out_of_bounds_values_by_name():
    for name, (_, row) in TABLE.items():
        if row.kind == "int":
            for bad in (row.low - 1, row.high + 1, True, 2.0):
                with pytest.raises(ValueError, match=f"{name} must be an integer in \\[{row.low}, {row.high}\\]"):
                    check_option(name, bad)
        elif row.kind == "choice":
            with pytest.raises(ValueError, match=f"{name} must be one of"):
                EngineConfig(**{name: "nothing-of-the-kind"})
        elif row.kind in ("flag", "switch"):
            accepts = "True, False or None" if row.kind == "switch" else "True or False"
            with pytest.raises(ValueError, match=f"{name} must be {accepts}"):
                EngineConfig(**{name: "yes"})


def test_the_scheduler_reads_the_same_bounds():
    blocks = BlockManager(8, 4)
    with pytest.raises(ValueError, match=rf"max_num_seqs must be an integer in \[1, {MAX_SEQS}\]"):
        Scheduler(blocks, 0, 16)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        Scheduler(blocks, 8, 4)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_every_weight_format_the_package_has_is_an_option():
    formats = [m for m in MODES if m != "none"]
    assert list(TABLE["quant"][1].choices) == formats
    for quant in formats:
        EngineConfig(quant=quant)
        assert WeightFormat(quant).quant == quant


def test_llm_takes_fp16_weights(tiny_model_dir):
    with LLM(str(tiny_model_dir), device="cpu", kv_memory=1 << 20, quant="fp16") as llm:
        assert llm.features()["quant"] == "fp16"
        assert len(llm.generate([1, 2, 3], 4).output_ids) == 4


def test_the_step_has_no_feature_branch():
    """schedule -> run -> postprocess: every feature acts through the part it changes. The step
    may only ask whether there is work and whether a tracer listens."""
    source = inspect.getsource(LLMEngine.step)
    tree = ast.parse(inspect.cleandoc("\n" + source) if source.startswith(" ") else source)
    tests = [ast.unparse(node.test) for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp))]
    assert tests == ["not work.requests", "self.on_step"], tests


def test_the_book_lists_no_option_the_table_lacks():
    """Chapter 9's page shows the table itself (an include), so it cannot drift; this keeps it so."""
    page = (REPO_ROOT / "book" / "chapter9" / "13-engine-assembled.md").read_text()
    assert '--8<-- "minivllm/config.py:options"' in page
