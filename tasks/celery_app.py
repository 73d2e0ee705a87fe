"""The workers' Celery application (`celery -A tasks.celery_app worker|flower`): the farm's app with the generation
tasks, and the kombu patches consumers need (its reconnect fix, no acknowledgement of a message never copied).

Publishers (the API, the batch driver's gateway) build their app with `farm.infra.broker.make_celery` and never import
this module; the batch driver has its own app (tasks/batch.py), so neither loads the engine.
"""

from __future__ import annotations

from farm.infra.broker import ack_only_copied_messages, make_celery, survive_broker_reconnects

app = make_celery(include=["tasks.generation"])
survive_broker_reconnects()
ack_only_copied_messages()
