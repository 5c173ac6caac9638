"""Stand-in for torch: `dynamo.trtllm`'s handler modules use ``torch.Tensor`` in annotations and
name a few dtypes and ``torch.nn.Module`` at import time; the text path runs no tensor code."""

from . import cuda, nn  # noqa: F401


class Tensor:  # only ever used as a type here
    pass


class dtype:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


for _name in ("bfloat16", "bool", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64",
              "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
              "int16", "int32", "int64", "int8", "uint16", "uint32", "uint64", "uint8"):
    globals()[_name] = dtype(_name)
