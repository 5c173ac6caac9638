class Module:  # subclassed at import time by multimodal helpers the text path does not use
    pass
