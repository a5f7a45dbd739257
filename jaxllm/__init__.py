"""jaxllm: an LLM serving engine on JAX/XLA.

from jaxllm import LLM, SamplingParams
"""

from jaxllm.llm import LLM
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
