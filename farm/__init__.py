"""Inference Farm: an OpenAI-compatible LLM serving farm on Celery + Redis."""

__version__ = "0.1.0"
