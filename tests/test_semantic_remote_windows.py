"""The remote guard's windows over a long message (farm.semantic.remote_guard.windows): every character is in a
window, consecutive windows overlap, none is longer than asked, and a short text is sent whole."""

from __future__ import annotations

import random

import pytest

from farm.semantic.remote_guard import windows


@pytest.mark.parametrize("n,spaces", [(1001, True), (2500, True), (10_000, True), (5000, False), (3333, True)])
def test_windows_cover_the_text_with_overlap(n, spaces):
    rng = random.Random(n)
    alphabet = "abcdefgh" + (" " if spaces else "")
    text = "".join(rng.choice(alphabet) for _ in range(n))
    size = 1000
    ws = windows(text, size)
    starts, at = [], 0
    for w in ws:
        start = text.index(w, at)  # in order, each a slice of the text
        starts.append(start)
        at = start + 1
        assert 0 < len(w) <= size
    assert starts[0] == 0 and starts[-1] + len(ws[-1]) == len(text)  # from the first character to the last
    for (a, wa), b in zip(zip(starts, ws, strict=True), starts[1:], strict=False):
        assert b < a + len(wa) - size // 20, (a, b)  # each window overlaps the next by at least 5% of a window


def test_a_text_up_to_the_window_is_sent_whole():
    assert windows("x" * 1000, 1000) == ["x" * 1000]
    assert windows("", 1000) == [""]
