async def async_load_video(*_args, **_kwargs):  # import-time placeholder
    raise NotImplementedError("async_load_video stand-in: not used by the text path")
