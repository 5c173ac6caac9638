class SharedTensorContainer:  # import-time placeholder (dynamo.trtllm.multimodal.cuda_ipc)
    def __init__(self, *_args, **_kwargs):
        raise NotImplementedError("SharedTensorContainer stand-in: not used by the text path")
