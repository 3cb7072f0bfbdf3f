"""Output tokens per tag (tenant), counted without touching decoding sequences one by one: each
decoding sequence adds one token per step, so a tag's count moves by (its decoding sequences) ×
(steps since it was last folded), and only a change of that number needs bookkeeping."""

from __future__ import annotations

from collections import Counter

__all__ = ["TagTokens"]


class TagTokens:
    def __init__(self) -> None:
        self.decoding: Counter[str] = Counter()  # decoding sequences per tag
        self._tokens: Counter[str] = Counter()  # as of each tag's last fold
        self._since: dict[str, int] = {}  # the step each tag was last folded at

    def sampled(self, tag: str) -> None:
        """A prefill step sampled a sequence's token (decodes are counted by the step)."""
        self._tokens[tag] += 1

    def started_decoding(self, tag: str, step: int) -> None:
        self._fold(tag, step)
        self.decoding[tag] += 1

    def stopped_decoding(self, tag: str, step: int) -> None:
        self._fold(tag, step)
        self.decoding[tag] -= 1

    def totals(self, step: int) -> dict[str, int]:
        """Output tokens generated so far, per tag, as of `step`."""
        for tag in list(self._since):
            self._fold(tag, step)
        return dict(self._tokens)

    def _fold(self, tag: str, step: int) -> None:
        since = self._since.get(tag, step)
        self._tokens[tag] += self.decoding[tag] * (step - since)
        self._since[tag] = step
