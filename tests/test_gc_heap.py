"""A warm farm process keeps its start-up objects out of the garbage collector's full passes (farm.infra.gc_heap).

Each check runs in a fresh interpreter: freezing is for the whole process, and this one's heap is pytest's."""

from __future__ import annotations

import os

from tests.procs import run_python


def test_frozen_objects_are_skipped_by_full_collections_and_new_garbage_is_still_collected():
    got = run_python("""
        import gc, json
        from farm.infra.gc_heap import freeze_startup_heap

        class Node:
            def __init__(self):
                self.peer = self

        kept = [Node() for _ in range(10_000)]       # start-up state: lives as long as the process
        Node(); Node()                               # start-up garbage: two cycles nobody holds
        frozen = freeze_startup_heap()
        tracked = gc.get_objects()                   # every generation the collector still walks
        walked = sum(1 for o in tracked if isinstance(o, Node))
        del tracked
        Node(); Node(); Node()                       # garbage made while serving
        print(json.dumps({"frozen": frozen, "walked": walked, "collected": gc.collect(),
                          "left": sum(1 for o in gc.get_objects() if isinstance(o, Node))}))
    """)
    assert got["frozen"] >= 10_000
    assert got["walked"] == 0  # the kept nodes (and the start-up cycles' leftovers: none) are out of its passes
    assert got["collected"] >= 3  # cycles made after the freeze are collected as before
    assert got["left"] == 0


def test_the_api_freezes_its_heap_once_warm_under_gevent(farm_env, redis_client):
    """gunicorn's gevent worker warms the tokenizers in create_app; what they loaded is then frozen."""
    got = run_python("""
        import gc, json
        import api.app
        from farm.config import get_config

        api.app.cooperative = lambda: True           # as under gunicorn's gevent worker (the warm-up runs in place)
        app = api.app.create_app(warm_semantic=False)
        ctx = app.extensions["farm"]
        tok = ctx.tokenizer(get_config().default_model)
        walked = any(o is tok for o in gc.get_objects())
        print(json.dumps({"frozen": gc.get_freeze_count(), "tokenizer_walked": walked}))
    """, env=os.environ | farm_env)
    assert got["frozen"] > 100_000  # the tokenizer and its chat template, Flask, pydantic, redis-py...
    assert got["tokenizer_walked"] is False
