"""KV cache tiers below the device (what Dynamo calls KVBM): host memory and local disk."""
