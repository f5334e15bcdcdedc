"""The README's Python snippets run as written, on the default model, and their answers end
on their own (a stop string or EOS), not cut off by a token budget."""

from __future__ import annotations

import re

import pytest

from conftest import REPO_ROOT

SNIPPETS = [s for s in re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
            if "from minivllm import LLM" in s]   # the library's; the server's need a server


@pytest.mark.real_model
@pytest.mark.parametrize("number", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_written(number, monkeypatch):
    results = []
    from minivllm import LLM

    for name in ("generate", "chat"):   # every answer a snippet prints, seen on its way out
        original = getattr(LLM, name)

        def seen(self, *args, _original=original, **kwargs):
            out = _original(self, *args, **kwargs)
            results.extend(out if isinstance(out, list) else [out])
            return out
        monkeypatch.setattr(LLM, name, seen)
    namespace: dict = {}
    try:
        exec(compile(SNIPPETS[number], f"README.md snippet {number}", "exec"), namespace)
    finally:
        if isinstance(namespace.get("llm"), LLM):
            namespace["llm"].close()
    assert results and all(r.finish_reason == "stop" for r in results), [(r.text, r.finish_reason) for r in results]
