"""What an encoded prompt says: base64, hex and ROT13 runs decoded to the text the model would read.

Why: an attack sent encoded ("Decode the following BASE64 ...: SG93IGRv...") reads as noise to the embedding
and to word n-grams, and a model that decodes it follows it (garak's `encoding` probes). The jailbreak guard
scores a message and each of its decoded forms and keeps the worst. A form counts only when it decodes to
text a person would write (mostly letters, several words), so image data, keys and hashes stay what they are
and cost nothing more than a regular expression.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re

_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2}[ :]?){12,}")
_WORD = re.compile(r"[a-z]+")
# the commonest English words: a ROT13 text has almost none of them, its decoding many
_COMMON = frozenset("the to and how a of you is in for what i make can do with on be it that this me my your are "
                    "write give tell an or from about step by".split())
DECODING_VERSION = "base64+hex+rot13/1"  # part of the jailbreak detector's digest: bump when the rules change
MAX_FORMS = 3
MAX_CHARS = 4000  # of a decoded form: enough for any prompt worth decoding


def _readable(text: str) -> bool:
    """Text a person would write: printable, mostly letters and spaces, at least three words."""
    if not text or any(not (c.isprintable() or c in "\n\t") for c in text):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters >= 0.8 * len(text) and len(text.split()) >= 3


def _from_base64(run: str) -> str | None:
    padded = run + "=" * (-len(run) % 4)
    try:
        raw = (base64.urlsafe_b64decode if ("-" in run or "_" in run) else base64.b64decode)(padded)
        return raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _from_hex(run: str) -> str | None:
    try:
        return bytes.fromhex(re.sub(r"[ :]", "", run)).decode("utf-8")
    except ValueError:
        return None


def _common_words(text: str) -> int:
    return sum(w in _COMMON for w in _WORD.findall(text.lower()))


def decoded_forms(text: str) -> list[str]:
    """The readable texts hidden in `text` as base64 or hex runs, or the whole text read as ROT13 when that
    has far more common English words than the text itself (at most MAX_FORMS, each cut to MAX_CHARS)."""
    forms: list[str] = []
    for pattern, decode in ((_BASE64, _from_base64), (_HEX, _from_hex)):
        for run in pattern.findall(text):
            decoded = decode(run.strip())
            if decoded and _readable(decoded) and decoded not in forms:
                forms.append(decoded[:MAX_CHARS])
    rot = codecs.encode(text, "rot13")
    if _common_words(rot) >= 3 and _common_words(rot) > 2 * _common_words(text):
        forms.append(rot[:MAX_CHARS])
    return forms[:MAX_FORMS]
