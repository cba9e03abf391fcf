"""The embedded engine: a small server of SGLang's /generate protocol (server: the endpoints; protocol: what they
accept; batcher: continuous batching; kvcache: the batch's state and the prefix cache; weights: loading, publishing
into and releasing them; httpjson: the HTTP layer), its HTTP clients and the OpenAI-compatible token gateway.
Machinery, no paper section; the paper's side of the protocol is rollout.py."""
