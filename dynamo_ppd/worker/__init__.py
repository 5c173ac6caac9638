"""The simulated TensorRT-LLM worker: the engine model of `dynamo_ppd.engine` served as a Dynamo
component (`python -m dynamo_ppd.worker`), in place of `python -m dynamo.trtllm`.

`args` is its command line (dynamo.trtllm's flag names), `live` runs the clock-free `Engine` on the
wall clock (asyncio), and `handler` is the Dynamo adapter: registration, the request contract of
dynamo.trtllm, streaming, KV events and load metrics.
"""
