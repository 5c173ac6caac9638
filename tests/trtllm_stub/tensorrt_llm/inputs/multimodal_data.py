class VideoData:  # import-time placeholder (dynamo.trtllm.multimodal_processor)
    def __init__(self, *_args, **_kwargs):
        raise NotImplementedError("VideoData stand-in: not used by the text path")
