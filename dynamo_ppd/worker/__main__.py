"""`python -m dynamo_ppd.worker`: the simulated TensorRT-LLM worker."""

from .handler import main

main()
