"""KV transfer: signed handles naming held KV blocks, and transports that move the blocks."""
