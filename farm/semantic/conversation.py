"""The category of a conversation, not of its last turn (MoM's conversation affinity).

Classified turn by turn, a conversation moves whenever a follow-up reads like another subject: "Thanks, now make
it shorter" after a calculus question is no subject at all. MoM would then answer it with another model (which
never saw how the conversation began) or put another category's system prompt in front of the same history, so
no block of the history the workers cached on the turns before is found again (the Semantic Router's issues
#1439 and #2503 ask for this). So in a conversation the category is the one its **first user turn the classifier
was sure of** (confidence at or above `semantic.classifier.threshold`) got, the decision that turn itself received
when it was the last one. Nothing is stored: every request carries its history, and the fold below gives the same
answer for the same turns, so the same model, reasoning mode and system prompt stay in front of the conversation
as it grows.

A later turn moves the conversation only when its own category differs and is at least
`semantic.conversation.switch_confidence` sure (None: never), or when an operator's keyword rule routes it (a
category with `keywords`: the route was written for exactly such a turn); from that turn on it is the
conversation's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from farm.semantic.classifier import Category

V = TypeVar("V")  # what a turn's text was encoded to (farm.semantic.embeddings.Encoded in the layer)


@dataclass(frozen=True)
class ConversationCategory:
    category: Category  # what decides this request's route
    turn: Category  # the last user turn's own category
    decided_at: int  # the index (0-based, among the user turns) of the turn whose category stands
    switched: bool = False  # a later turn moved the conversation (switch_confidence)


def conversation_category(turns: Sequence[tuple[V, str]], decide: Callable[[V, str], Category],
                          threshold: float, switch_confidence: float | None,
                          keyword: Callable[[str], str | None] | None = None) -> ConversationCategory:
    """Fold the user turns (each its encoding and text, oldest first; at least one) into the conversation's
    category. Turns after the first accepted one are classified only when they could move it (`switch_confidence`,
    or a keyword rule: `keyword(text)` names the category one routes the text to) and for the last turn's own
    category."""
    last = len(turns) - 1
    current: Category | None = None
    at, switched = last, False
    for i, (vec, text) in enumerate(turns):
        pinned = current is not None and keyword is not None and keyword(text) not in (None, current.name)
        if current is not None and switch_confidence is None and i < last and not pinned:
            continue  # nothing after the first accepted turn can move the conversation
        d = decide(vec, text)
        if current is None:
            if d.confidence >= threshold or i == last:
                current, at = d, i
        elif d.name != current.name and (d.rule == "keyword" or (
                switch_confidence is not None and d.confidence >= switch_confidence)):
            current, at, switched = d, i, True
        if i == last:
            return ConversationCategory(current, d, at, switched)
    raise ValueError("a conversation needs at least one user turn")
