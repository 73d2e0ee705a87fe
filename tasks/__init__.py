"""Celery tasks of the farm: thin wrappers that hand work to the in-process engine."""
