"""minivllm: the book's inference engine as a package, one module per concern.

    from minivllm import LLM, SamplingParams
    llm = LLM()                                   # the default model, on the CPU or a GPU
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8)).text)

Each module says which chapter of the book teaches it and imports only modules of its own or
earlier chapters; `llm.py` is the one place that wires the features together. Importing the
package loads torch and transformers' tokenizers, never a web framework.
"""

from minivllm.contracts import BaseOfflineEngine, GenerateResult, RequestMetrics, SamplingParams
from minivllm.llm import LLM
from minivllm.lora import LoRARequest
from minivllm.many_answers import BeamSearchParams

__all__ = ["LLM", "LoRARequest", "BeamSearchParams", "BaseOfflineEngine", "GenerateResult", "RequestMetrics", "SamplingParams"]
