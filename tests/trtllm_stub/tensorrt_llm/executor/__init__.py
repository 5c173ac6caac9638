from .result import CompletionOutput, GenerationResult  # noqa: F401
