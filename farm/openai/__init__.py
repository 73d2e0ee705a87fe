"""The OpenAI protocol without a web framework: request models (the one source of validation and of the OpenAPI
document), parsing into token ids and sampling, response shapes, log-probabilities and the error type.

The HTTP entry point (`api/`) and the batch driver (`farm/batch/`) both build on it, as vLLM's `run_batch`
reuses its serving layer's protocol code; nothing here imports Flask.
"""
