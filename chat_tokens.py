"""The chat template's special tokens (Qwen ChatML): the one source for model, gateway, rollout and tito.

A leaf module with no imports, so that tito.py (which imports nothing above it), terminus2.py and the gateway read
the same names as model.py, whose template and tokenizer use them.
"""
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"  # ids 0, 1, 2 of model.py's tokenizer
ASSISTANT_PREFIX = IM_START + "assistant\n"
