"""`python -m dynamo_ppd.engine`: the simulated TensorRT-LLM worker."""

from .worker import main

main()
