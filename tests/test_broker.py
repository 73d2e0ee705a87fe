"""The generation tasks' publisher (farm.infra.broker.TaskPublisher): the message it writes is the one Celery's own
send_task writes, and kombu's consumer reads it back, priorities included."""

from __future__ import annotations

import base64
import json

import pytest
from kombu import Connection
from kombu.transport import redis as kombu_redis

from farm.config import load_config
from farm.infra.broker import PRIORITY_SEP, PRIORITY_STEPS, TaskPublisher, make_celery, priority_queue_key
from farm.protocol import TASK_GENERATE

REQUEST = {"request_id": "chatcmpl-x@1", "model": "m", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 2}}


@pytest.fixture()
def celery_app(redis_url):
    return make_celery(load_config(environ={"FARM_REDIS__URL": redis_url}))


def _entry(r, key: str) -> dict:
    (raw,) = r.lrange(key, 0, -1)
    return json.loads(raw)


def test_the_message_is_the_one_celery_send_task_writes(redis_client, celery_app):
    celery_app.send_task(TASK_GENERATE, args=[REQUEST], queue="farm.w.celery", task_id="chatcmpl-x@1.generate",
                         argsrepr="(<request chatcmpl-x@1: prompt not shown>)", kwargsrepr="{}")
    TaskPublisher(redis_client).send(TASK_GENERATE, [REQUEST], "farm.w.lean")
    ours, celery = _entry(redis_client, "farm.w.lean"), _entry(redis_client, "farm.w.celery")
    assert ours.keys() == celery.keys()
    assert json.loads(base64.b64decode(ours["body"])) == json.loads(base64.b64decode(celery["body"]))
    for part, differ in (("headers", {"origin"}), ("properties", {"delivery_tag", "reply_to", "delivery_info"})):
        assert ours[part].keys() == celery[part].keys(), part
        assert {k: v for k, v in ours[part].items() if k not in differ} == \
            {k: v for k, v in celery[part].items() if k not in differ}, part
    assert ours["properties"]["delivery_info"] == {"exchange": "", "routing_key": "farm.w.lean"}
    # the prompt never reaches the argument text Celery logs and puts in task events
    assert "prompt not shown" in ours["headers"]["argsrepr"] and "5, 6, 7" not in ours["headers"]["argsrepr"]


def test_priorities_go_to_the_lists_kombu_polls():
    channel = kombu_redis.Channel.__new__(kombu_redis.Channel)  # only its queue naming is used
    channel.priority_steps = list(PRIORITY_STEPS)
    assert PRIORITY_SEP == kombu_redis.Channel.sep
    for pri in range(10):
        assert priority_queue_key("farm.w.x", pri) == channel._q_for_pri("farm.w.x", pri), pri


def test_a_kombu_consumer_reads_them_back_high_priority_first(redis_client, redis_url):
    TaskPublisher(redis_client, priority=9).send(TASK_GENERATE, [dict(REQUEST, request_id="batch-line")], "farm.w.q")
    TaskPublisher(redis_client).send(TASK_GENERATE, [REQUEST], "farm.w.q", headers={"traceparent": "00-ab-cd-01"})
    options = {"queue_order_strategy": "priority"}
    with Connection(redis_url, transport_options=options) as conn:
        queue = conn.SimpleQueue("farm.w.q", no_ack=True)
        got = [queue.get(timeout=5) for _ in range(2)]
        queue.close()
    assert [m.headers["id"] for m in got] == ["chatcmpl-x@1.generate", "batch-line.generate"]
    assert got[0].headers["traceparent"] == "00-ab-cd-01"
    args, kwargs, _embed = got[0].decode()
    assert args == [REQUEST] and kwargs == {}
    assert got[1].properties["priority"] == 9


def _consume_one(redis_url: str, queue_name: str, no_ack: bool):
    """One message taken by a kombu consumer as a Celery worker takes it; (connection, message)."""
    from kombu import Exchange, Queue

    conn = Connection(redis_url)
    got = []
    consumer = conn.Consumer(Queue(queue_name, Exchange(queue_name), routing_key=queue_name, no_ack=no_ack),
                             callbacks=[lambda _body, message: got.append(message)], accept=["json"])
    consumer.consume()
    conn.drain_events(timeout=5)
    return conn, got[0]


def _zrems(r) -> int:
    return r.info("commandstats").get("cmdstat_zrem", {}).get("calls", 0)


def test_an_acknowledgement_costs_redis_nothing_for_a_message_never_copied(redis_client, redis_url):
    from farm.infra.broker import ack_only_copied_messages

    ack_only_copied_messages()
    ack_only_copied_messages()  # idempotent
    publisher = TaskPublisher(redis_client)
    unacked = "unacked"  # kombu's copies of messages taken with acks, by delivery tag
    redis_client.delete(unacked)
    publisher.send(TASK_GENERATE, [REQUEST], "farm.shared.q")  # a shared queue: taken with a copy, acked
    conn, message = _consume_one(redis_url, "farm.shared.q", no_ack=False)
    assert redis_client.hexists(unacked, message.delivery_tag)
    message.ack()
    assert not redis_client.hexists(unacked, message.delivery_tag)
    conn.release()
    publisher.send(TASK_GENERATE, [REQUEST], "farm.w.own")  # a worker's own queue: no copy, no round trip
    conn, message = _consume_one(redis_url, "farm.w.own", no_ack=True)
    assert not redis_client.hexists(unacked, message.delivery_tag)
    before = _zrems(redis_client)
    message.ack()  # what Celery does for an acks_late task once it returned
    assert _zrems(redis_client) == before
    conn.release()
