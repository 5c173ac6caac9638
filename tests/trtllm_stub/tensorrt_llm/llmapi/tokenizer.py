"""Import-time placeholder (dynamo.trtllm.multimodal_processor imports it; text requests with
``--modality text`` never build a multimodal processor)."""


def tokenizer_factory(*_args, **_kwargs):
    raise NotImplementedError("tokenizer_factory stand-in: not used by the text path")
