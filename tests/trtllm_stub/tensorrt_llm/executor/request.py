"""Imitates tensorrt_llm/executor/request.py: only the default priority (Dynamo's own tests, in
the 1.6.1 wheel, test_trtllm_handler_base.py, expect 0.5 for a request without one)."""

DEFAULT_REQUEST_PRIORITY = 0.5
