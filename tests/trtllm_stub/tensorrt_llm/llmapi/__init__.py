"""Imitates tensorrt_llm/llmapi/__init__.py, the names dynamo.trtllm imports from it.

``BuildConfig`` is deliberately absent: TensorRT-LLM >= 1.3.0rc21 removed it from llmapi
(dynamo/trtllm/backend_args.py 1.6.1 says so and falls back to ``llm_args.BaseLlmArgs``), and the
pinned rc29 is such a version. ``ConversationParams`` is absent too (conversation affinity is off
in every test; dynamo.trtllm then reports the API as unavailable and never calls it)."""

from ..disaggregated_params import DisaggregatedParams  # noqa: F401
from ..sampling_params import SamplingParams  # noqa: F401
from .llm import LLM, RequestOutput  # noqa: F401
