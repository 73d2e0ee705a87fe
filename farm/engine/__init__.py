"""The built-in engine: paged KV cache, prefix caching, continuous batching, sampling."""
