"""File bodies in Redis (`batch.files_backend: redis`, what compose and the Helm chart use): two API replicas
with state dirs of their own see the same files, bodies larger than one chunk go in and out intact, the cap
refuses uploads (413) but never a batch's output, and deleting frees the room. A real Redis; no workers."""

from __future__ import annotations

import io
import os

import pytest

from api.app import create_app
from farm.batch.file_store import CHUNK_BYTES, FileStorageFull, FileStore
from farm.config import ConfigError, load_config
from farm.protocol.keys import FILE_BYTES_KEY
from tests.security_helpers import KEY_A, KEY_B, bearer


def upload(c, data: bytes, name="in.jsonl", key: str = KEY_A):
    return c.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(data), name)},
                  content_type="multipart/form-data", headers=bearer(key))


def pods(redis_url, tmp_path, monkeypatch, **env: str) -> list:
    """Two API apps on one Redis with keys A and B, each with a state dir (and so a files dir) of its own, like two
    pods; file bodies in Redis, `env` on top."""
    monkeypatch.setenv("FARM_API_KEYS", f"{KEY_A},{KEY_B}")
    return [create_app(load_config(environ={
        "FARM_REDIS__URL": redis_url, "FARM_STATE_DIR": str(tmp_path / f"pod{i}"), "FARM_BATCH__FILES_BACKEND": "redis",
        "FARM_SEMANTIC__ENABLED": "false", **env}), warm_semantic=False) for i in range(2)]


@pytest.fixture
def replicas(redis_url, redis_client, tmp_path, monkeypatch):
    """3 MB for every key's files, 2 MB for each key's."""
    apps = pods(redis_url, tmp_path, monkeypatch, FARM_BATCH__FILES_REDIS_MAX_MB="3", FARM_BATCH__OWNER_FILES_MAX_MB="2")
    yield [a.test_client() for a in apps], redis_client
    for a in apps:
        a.extensions["farm"].gateway.stop()


def test_a_file_uploaded_to_one_replica_is_read_from_another(replicas, tmp_path):
    (a, b), r = replicas
    data = os.urandom(CHUNK_BYTES + 12345)  # more than one chunk each way
    f = upload(a, data).get_json()
    assert f["bytes"] == len(data)
    got = b.get(f"/v1/files/{f['id']}/content", headers=bearer(KEY_A))
    assert got.status_code == 200 and got.data == data
    assert b.get(f"/v1/files/{f['id']}", headers=bearer(KEY_A)).get_json()["bytes"] == len(data)
    assert not any(p.is_file() for p in tmp_path.rglob("file-*")), "nothing on either pod's disk"
    assert int(r.get(FILE_BYTES_KEY)) == len(data)
    assert b.delete(f"/v1/files/{f['id']}", headers=bearer(KEY_A)).get_json()["deleted"] is True
    assert a.get(f"/v1/files/{f['id']}/content", headers=bearer(KEY_A)).status_code == 404
    assert int(r.get(FILE_BYTES_KEY)) == 0
    assert not r.keys("farm:file:*"), "metadata, body and upload keys are all gone"


def test_the_cap_refuses_uploads_but_not_a_batchs_output(replicas, redis_url, tmp_path):
    (a, b), r = replicas
    two_mb = os.urandom(2 << 20)
    first = upload(a, two_mb)
    assert first.status_code == 200
    full = upload(b, two_mb, key=KEY_B)  # 4 MB in all would pass the 3 MB cap (each key within its 2 MB)
    assert full.status_code == 413
    err = full.get_json()["error"]
    assert err["code"] == "file_storage_full" and err["param"] == "file" and "files_redis_max_mb" in err["message"]
    assert int(r.get(FILE_BYTES_KEY)) == len(two_mb) and not r.keys("farm:file:*:upload:*")
    # a batch's output file is stored whatever the cap (the work was accepted), and counted
    cfg = load_config(environ={"FARM_REDIS__URL": redis_url, "FARM_STATE_DIR": str(tmp_path / "driver"),
                               "FARM_BATCH__FILES_BACKEND": "redis", "FARM_BATCH__FILES_REDIS_MAX_MB": "3"})
    store = FileStore.from_config(r, cfg)
    out = store.create([two_mb[:CHUNK_BYTES], two_mb[CHUNK_BYTES:]], "batch_out.jsonl", "batch_output")
    assert store.read(out["id"]) == two_mb
    assert int(r.get(FILE_BYTES_KEY)) == 2 * len(two_mb)
    with pytest.raises(FileStorageFull):
        store.create(b"x" * 10, "more.jsonl", "batch")
    # replacing a file (a finalizing batch rewrites its output) counts the new size, not both
    store.create(b"short\n", "batch_out.jsonl", "batch_output", file_id=out["id"])
    assert int(r.get(FILE_BYTES_KEY)) == len(two_mb) + len(b"short\n")
    assert a.delete(f"/v1/files/{first.get_json()['id']}", headers=bearer(KEY_A)).status_code == 200
    assert upload(b, two_mb, key=KEY_B).status_code == 200, "deleting made room again"


def test_one_key_cannot_fill_the_room_every_keys_uploads_share(redis_url, redis_client, tmp_path, monkeypatch):
    """In Redis all keys' uploads share files_redis_max_mb. A key's own quota defaults to a quarter of it, so one
    key within its quota leaves the others room (it took all of it: B's upload was 413 file_storage_full), and a
    quota set at or above it is refused when the configuration loads."""
    apps = pods(redis_url, tmp_path, monkeypatch, FARM_BATCH__FILES_REDIS_MAX_MB="4")
    a, b = (app.test_client() for app in apps)
    one_mb = os.urandom(1 << 20)
    try:
        assert upload(a, one_mb, key=KEY_A).status_code == 200
        refused = upload(b, one_mb, key=KEY_A)  # A's second MB passes its quota (1 MB), not the farm's room
        assert refused.status_code == 413 and refused.get_json()["error"]["code"] == "file_quota_exceeded"
        assert upload(b, one_mb, key=KEY_B).status_code == 200
    finally:
        for app in apps:
            app.extensions["farm"].gateway.stop()
    with pytest.raises(ConfigError, match="must be below batch.files_redis_max_mb"):
        load_config(environ={"FARM_BATCH__FILES_BACKEND": "redis", "FARM_BATCH__FILES_REDIS_MAX_MB": "4",
                             "FARM_BATCH__OWNER_FILES_MAX_MB": "4"})
    assert load_config(environ={"FARM_BATCH__OWNER_FILES_MAX_MB": "4096"}).batch.owner_files_max_mb == 4096  # disk
