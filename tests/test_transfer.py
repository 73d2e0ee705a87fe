"""KV handles and the TCP transport: signed, verified before any transfer, checksummed, released."""

from __future__ import annotations

import os
import time

import pytest
import torch

from farm.config import EngineConfig
from farm.engine.engine import Engine
from farm.engine.scheduler import KVImport
from farm.protocol import SamplingParams
from farm.protocol.hashing import block_hashes, salt_root
from farm.transfer.handle import HandleError, check_bound, sign_handle, verify_handle
from farm.transfer.shm import host_id, import_from_shm
from farm.transfer.tcp import TransferError, TransferServer, checksum, fetch_blocks

SECRET = b"k" * 32


def base_handle(**kw):
    h = {"request_id": "r1", "worker_id": "w1", "endpoint": "127.0.0.1:1", "transport": "tcp",
         "host_id": "elsewhere",
         "block_ids": [1, 2], "block_hashes": ["9"], "num_tokens": 20, "first_token": 5, "cached_tokens": 0,
         "layout": {}, "checksum": "0", "expires_at": time.time() + 60}
    h.update(kw)
    return h


def test_sign_verify_and_tamper_detection():
    h = sign_handle(base_handle(), SECRET)
    assert verify_handle(h, SECRET) == h
    for field, value in [("endpoint", "10.0.0.1:22"), ("block_ids", [0, 1, 2]), ("expires_at", time.time() + 1e6)]:
        forged = dict(h, **{field: value})
        with pytest.raises(HandleError, match="signature"):
            verify_handle(forged, SECRET)
    with pytest.raises(HandleError, match="signature"):
        verify_handle(h, b"other-secret")
    with pytest.raises(HandleError, match="expired"):
        verify_handle(sign_handle(base_handle(expires_at=time.time() - 1), SECRET), SECRET)
    with pytest.raises(HandleError):
        verify_handle({"request_id": "x"}, SECRET)


@pytest.fixture
def prefill_side(tiny_model_dir):
    eng = Engine(tiny_model_dir, EngineConfig(block_size=4), max_model_len=256).start()

    def check(h):
        if h["request_id"] not in eng.held:
            raise TransferError("not held")

    server = TransferServer("w1", SECRET, check, eng.runner.read_blocks, eng.release_held, "127.0.0.1").start()
    yield eng, server
    server.stop()
    eng.stop()


def hold(eng, prompt):
    import threading

    box, done = {}, threading.Event()

    def cb(o):
        if o.finished:
            box["o"] = o
            done.set()

    eng.submit("r1", prompt, SamplingParams(max_tokens=4, temperature=0), cb, prefill_only=True)
    assert done.wait(30)
    return box["o"]


def make_handle(eng, server, out, **kw):
    data = eng.runner.read_blocks(out.held_blocks)
    fields = {"endpoint": f"127.0.0.1:{server.port}", "block_ids": out.held_blocks,
              "layout": eng.runner.layout.to_dict(), "checksum": checksum(data), **kw}
    return sign_handle(base_handle(**fields), SECRET)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pull_returns_exact_blocks_and_releases_them(prefill_side, transport):
    eng, server = prefill_side
    out = hold(eng, list(range(100, 118)))
    expected = eng.runner.read_blocks(out.held_blocks).clone()
    h = make_handle(eng, server, out, transport="tcp,shm", host_id=host_id() if transport == "shm" else "other")
    before = set(os.listdir("/dev/shm"))
    data = fetch_blocks(h, SECRET)
    assert set(os.listdir("/dev/shm")) == before  # the shared-memory file is gone once mapped
    assert torch.equal(data, expected)
    deadline = time.time() + 2
    while eng.held and time.time() < deadline:
        time.sleep(0.02)
    assert not eng.held and eng.pool.num_free == eng.pool.num_blocks
    with pytest.raises(TransferError, match="not held|refused"):
        fetch_blocks(h, SECRET)  # already pulled


def test_blocks_its_decode_will_not_pull_are_freed_only_on_a_handle_of_ours(prefill_side):
    """A decode whose request was cancelled, or whose pull failed, gives the handle back (farm.release_kv): the
    blocks are freed then, not when the handle expires (120 s). A handle signed with another key or naming
    another worker frees nothing."""
    eng, server = prefill_side
    generated = eng.tokens_generated
    out = hold(eng, list(range(300, 318)))
    assert eng.tokens_generated == generated + 1  # the first token, sampled here (vllm:generation_tokens_total)
    good = make_handle(eng, server, out)
    assert not server.release_unpulled(sign_handle(dict(good), b"attacker"))
    assert not server.release_unpulled(make_handle(eng, server, out, worker_id="w2"))
    assert not server.release_unpulled({"request_id": "r1"}) and not server.release_unpulled("not a handle")
    assert "r1" in eng.held
    assert server.release_unpulled(good)
    deadline = time.time() + 2
    while eng.held and time.time() < deadline:
        time.sleep(0.02)
    assert not eng.held and eng.pool.num_free == eng.pool.num_blocks
    with pytest.raises(TransferError, match="not held"):
        fetch_blocks(good, SECRET)
    assert not server.release_unpulled(good)  # once only


def test_forged_or_wrong_handles_are_refused_before_transfer(prefill_side):
    eng, server = prefill_side
    out = hold(eng, list(range(200, 212)))
    good = make_handle(eng, server, out)
    with pytest.raises(TransferError, match="signature"):
        fetch_blocks(dict(good, endpoint="127.0.0.1:9"), SECRET)
    with pytest.raises(TransferError, match="another worker"):
        fetch_blocks(make_handle(eng, server, out, worker_id="w2"), SECRET)
    with pytest.raises(TransferError, match="checksum"):
        fetch_blocks(make_handle(eng, server, out, checksum="deadbeef"), SECRET)
    # the server checks the signature too: a client with the wrong secret gets nothing
    with pytest.raises(TransferError, match="signature"):
        forged = sign_handle(dict(good), b"attacker")
        fetch_blocks(forged, b"attacker")


def test_unreachable_worker_is_a_transfer_error():
    from tests.conftest import free_port

    h = sign_handle(base_handle(endpoint=f"127.0.0.1:{free_port()}",
                                layout={"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "block_size": 4,
                                        "dtype": "float32"}), SECRET)
    with pytest.raises(TransferError, match="cannot pull"):
        fetch_blocks(h, SECRET, timeout=2)


def test_shm_refuses_paths_it_did_not_create():
    with pytest.raises(ValueError, match="refusing"):
        import_from_shm("/etc/passwd", 10, torch.uint8, (10,))
    with pytest.raises(ValueError, match="refusing"):
        import_from_shm("/dev/shm/../../etc/passwd", 10, torch.uint8, (10,))


def test_nixl_regions_describe_exactly_the_gathered_blocks():
    """The NIXL descriptor list, read region by region, is byte-identical to read_blocks' layout."""
    import ctypes

    from farm.transfer.nixl import block_regions

    kv = torch.randn(3, 2, 7, 4, 2, 5)
    ids = [5, 1, 3]
    regions = block_regions(kv, ids)
    assert len(regions) == 3 * 2 * 3 and all(size == 4 * 2 * 5 * 4 for _, size, _ in regions)
    joined = b"".join(ctypes.string_at(addr, size) for addr, size, _ in regions)
    expected = kv.view(6, 7, -1)[:, ids].contiguous().numpy().tobytes()
    assert joined == expected


def test_a_handle_is_bound_to_the_request_it_was_made_for():
    """The signature says a farm worker made the handle; check_bound says it was made for this task: its id, its
    prompt's length and its full blocks' hashes under its cache salt (a handle moved onto another task, by anyone
    who can write to the broker, would file one prompt's KV under another's hashes, in another tenant's cache)."""
    prompt = list(range(100, 118))  # 4 full blocks of 4 and a partial one
    hashes = [str(x) for x in block_hashes(prompt, 4, salt_root("tenant-a"))]
    h = sign_handle(base_handle(num_tokens=len(prompt), block_hashes=hashes), SECRET)
    check_bound(h, request_id="r1", prompt_ids=prompt, block_size=4, cache_salt="tenant-a")
    for kw, why in [({"request_id": "r2"}, "another request"),
                    ({"prompt_ids": prompt[:-1]}, "prompt length"),
                    ({"prompt_ids": [*prompt[:-1], 7]}, "prompt length"),  # same length: the hashes differ ...
                    ({"prompt_ids": [7, *prompt[1:]]}, "another prompt"),
                    ({"cache_salt": "tenant-b"}, "another prompt or cache salt"),
                    ({"cache_salt": None}, "another prompt or cache salt")]:
        args = {"request_id": "r1", "prompt_ids": prompt, "block_size": 4, "cache_salt": "tenant-a", **kw}
        if args["prompt_ids"] == [*prompt[:-1], 7]:
            check_bound(h, **args)  # ... but a changed token in the partial block is no block the handle names
            continue
        with pytest.raises(HandleError, match=why):
            check_bound(h, **args)
    with pytest.raises(HandleError):
        check_bound(["not", "a", "handle"], request_id="r1", prompt_ids=prompt, block_size=4, cache_salt=None)


@pytest.mark.parametrize("sig", ["é" * 64, "0" * 63, "G" * 64, "A" * 64, 7])
def test_a_malformed_signature_is_a_handle_error(sig):
    """Not a TypeError out of hmac.compare_digest (non-ASCII text), on the transfer port or the decode side."""
    with pytest.raises(HandleError, match="malformed"):
        verify_handle(dict(sign_handle(base_handle(), SECRET), sig=sig), SECRET)


def test_imported_kv_that_does_not_fit_fails_only_its_own_request(prefill_side):
    """A decode engine given KV for another prompt length or cache shape refuses that request at admission; the
    requests running beside it go on (before, the step's error failed every active request)."""
    eng, _ = prefill_side
    out = hold(eng, list(range(300, 318)))
    data = eng.runner.read_blocks(out.held_blocks).clone()
    eng.release_held("r1")
    import threading

    finished: dict[str, tuple[str, int]] = {}
    done = {k: threading.Event() for k in ("a", "b", "short", "shape")}

    def collect(rid):
        tokens = []

        def cb(o):
            tokens.extend(o.token_ids)
            if o.finished:
                finished[rid] = (o.finish_reason, len(tokens))
                done[rid].set()
        return cb

    for rid in ("a", "b"):
        eng.submit(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), collect(rid))
    eng.submit("short", list(range(300, 306)), SamplingParams(max_tokens=4, temperature=0), collect("short"),
               kv_import=KVImport(data, 18, int(out.first_token)))  # 18 tokens of KV for a 6-token prompt
    eng.submit("shape", list(range(300, 318)), SamplingParams(max_tokens=4, temperature=0), collect("shape"),
               kv_import=KVImport(data[:, :, :, :, :1], 18, int(out.first_token)))  # another head count
    assert all(e.wait(60) for e in done.values())
    for rid in ("short", "shape"):
        assert finished[rid][0].startswith("error") and "imported KV does not match" in finished[rid][0]
    assert finished["a"] == ("length", 40) and finished["b"] == ("length", 40)

