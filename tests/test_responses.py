"""SSE chunks: the fast text-delta path writes exactly what the general JSON path writes."""

from __future__ import annotations

import json

import pytest

from farm.openai.responses import ChunkWriter


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("text", [" hi", 'a "quote", a \\ backslash\nand a newline', "héllo ✓ 😀", "", "\x00\x1f"])
def test_text_delta_chunk_equals_the_json_encoded_chunk(kind, text):
    w = ChunkWriter(kind, "chatcmpl-0123", "some/model")
    choice = {"index": 2, "delta": {"content": text}} if kind == "chat" else {"index": 2, "text": text}
    expected = w._chunk([{**choice, "logprobs": None, "finish_reason": None}])
    got = w.delta(text, 2)
    assert got == expected
    body = json.loads(got.removeprefix("data: "))
    assert body["id"] == "chatcmpl-0123" and body["model"] == "some/model"
    assert (body["choices"][0]["delta"]["content"] if kind == "chat" else body["choices"][0]["text"]) == text
