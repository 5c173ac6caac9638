"""Imitates tensorrt_llm/executor/utils.py: the per-request error the executor raises while a
result is iterated (dynamo.trtllm answers it with an error chunk and keeps serving)."""


class RequestError(RuntimeError):
    pass
