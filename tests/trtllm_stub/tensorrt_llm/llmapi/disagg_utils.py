"""Imitates ``get_global_disagg_request_id`` of tensorrt_llm/llmapi/disagg_utils.py in its rc22+
form (``node_id``, ``process_id``: dynamo/trtllm/utils/disagg_utils.py 1.6.1 tells the two APIs
apart by that parameter): a positive int unique across a cluster's workers, which both the context
and the generation request then use as their executor request id. The bit layout here is ours."""

import itertools
import time

_counter = itertools.count(1)


def get_global_disagg_request_id(node_id: int, process_id: int) -> int:
    if not (0 <= node_id < 1 << 8 and 0 <= process_id < 1 << 6):
        raise ValueError(f"node_id {node_id} / process_id {process_id} out of range")
    millis = int(time.time() * 1000) & ((1 << 41) - 1)
    return (millis << 22) | (node_id << 14) | (process_id << 8) | (next(_counter) & 0xFF)
