"""Which earlier request's KV a prompt continues, for the engine model's prefix cache
(engine/prefix_cache.py), read from the text as vLLM's block hashes read it from the tokens.

A request leaves behind the text its KV holds: its prompt and what it generated (a chat
request's answer as an assistant message). A later prompt that starts with that text — a
continuation: a completions prompt with the output appended, or a chat request whose final
assistant message is the answer so far, `continue_final_message` — continues it. Only the most
recent texts are remembered: the engine's cache forgets older ones first anyway."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

REMEMBERED = 4096  # texts kept; a lookup scans them (an emulator's loads, not a server's)
ROLE, CONTENT = "\x00", "\x01"  # separators no message text carries


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as the KV holds it: chat messages role by role, or the completions prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"{ROLE}{m.get('role')}{CONTENT}{_text(m.get('content'))}"
            for m in messages
            if isinstance(m, dict)
        )
    return _text(body.get("prompt"))


def answer_opening(body: dict[str, Any]) -> str:
    """What the KV holds between the prompt and the answer's text: a chat answer is a new
    assistant message, unless the request continues its final one."""
    if isinstance(body.get("messages"), list) and not body.get("continue_final_message"):
        return f"{ROLE}assistant{CONTENT}"
    return ""


def _text(content: object) -> str:
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


class Prefixes:
    def __init__(self) -> None:
        self._texts: OrderedDict[str, str] = OrderedDict()  # engine prefix key → its text

    def continued(self, text: str) -> str:
        """The prefix key of the remembered text that shares the longest start with `text`,
        one being the start of the other ("": none). A client resumes from what it received,
        which may be less than the engine generated before the abort reached it."""
        best, length = "", 0
        for key, kept in self._texts.items():
            shared = len(kept) if text.startswith(kept) else len(text) * kept.startswith(text)
            if shared > length:
                best, length = key, shared
        return best

    def left(self, key: str, text: str) -> None:
        """A request under prefix `key` ended or was aborted, its KV holding `text`."""
        self._texts.pop(key, None)
        self._texts[key] = text
        while len(self._texts) > REMEMBERED:
            self._texts.popitem(last=False)
