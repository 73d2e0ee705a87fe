"""Who calls the farm and how much: API keys as digests and owner ids (`api_keys`), per-owner rate limits and
token quotas in Redis (`quota`)."""
