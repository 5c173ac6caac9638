"""Import-time placeholders for tensorrt_llm/inputs (multimodal input processing)."""


def create_input_processor(*_args, **_kwargs):
    raise NotImplementedError("create_input_processor stand-in: not used by the text path")
