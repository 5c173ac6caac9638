"""Stand-in for the blake3 package: `dynamo.trtllm.multimodal.hasher` imports it at module level
for multimodal content hashing, which text requests never reach."""


def blake3(*_args, **_kwargs):
    raise NotImplementedError("blake3 stand-in: multimodal hashing is not part of these tests")
