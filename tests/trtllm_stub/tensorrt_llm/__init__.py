"""Stand-in for TensorRT-LLM 1.3.0rc29 (the version Dynamo 1.6.1 pins), at the boundary
`dynamo.trtllm` uses: see ../README.md. `dynamo.trtllm.engine` imports ``LLM`` and
``MultimodalEncoder`` from the package root."""

from .llmapi.llm import LLM, MultimodalEncoder  # noqa: F401

__version__ = "1.3.0rc29+contract-stub"
