"""KV-aware routing: a Redis KV-block index fed by worker events, shared load, and the cost function."""
