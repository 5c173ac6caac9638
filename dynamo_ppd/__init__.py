"""dynamo-ppd: PPD router for NVIDIA Dynamo."""
__version__ = "0.1.0"
