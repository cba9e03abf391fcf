"""The embedded engine: a small server of SGLang's /generate protocol (server, batcher, KV cache, HTTP layer) and the
OpenAI-compatible token gateway. Machinery, no paper section; the paper's side of the protocol is rollout.py."""
