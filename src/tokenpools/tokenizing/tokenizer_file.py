"""Counting prompt tokens with a tokenizer file, no round trip: a `tokenizer.json` (every text
part and the tools encoded, chat framing estimated), or a GGUF model, whose byte-level BPE
vocabulary, special tokens and Jinja chat template are all inside it (the chat is rendered as
the engine renders it, then encoded). Needs the `tokenizer` extra: tokenizers, gguf, jinja2."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenpools.model.config import ConfigError
from tokenpools.prompt import FRAMING_TOKENS, prompt_parts

if TYPE_CHECKING:
    from jinja2 import Template
    from tokenizers import Tokenizer


@dataclass
class TokenizerFile:
    tokenizer: Tokenizer
    template: Template | None = None  # the model's chat template
    bos: str = ""  # what the engine puts before a templated prompt
    eos: str = ""

    def count(self, body: dict[str, Any]) -> int:
        if self.template is not None and isinstance(body.get("messages"), list):
            try:
                text = self.template.render(
                    messages=body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=True,
                    bos_token=self.bos,
                    eos_token=self.eos,
                )
            except Exception:  # a template can raise on what it does not expect: use the parts
                pass
            else:  # the engine adds BOS unless the template wrote it
                prompt = text if text.startswith(self.bos) else self.bos + text
                return len(self.tokenizer.encode(prompt, add_special_tokens=False).ids)
        texts, ids, messages = prompt_parts(body)
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        return max(1, sum(len(e.ids) for e in encoded) + ids + FRAMING_TOKENS * messages)


_LOADED: dict[Path, TokenizerFile] = {}


def load_tokenizer(path: Path) -> TokenizerFile:
    """A tokenizer.json or a GGUF model's tokenizer; read once per file."""
    if path in _LOADED:
        return _LOADED[path]
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            f"tokenizer {path}: a tokenizer file needs the tokenizers library "
            "(pip install 'tokenpools[tokenizer]')"
        ) from None
    if not path.is_file():
        raise ConfigError(f"tokenizer {path}: no such file (or give 'estimate' or 'backend')")
    try:
        loaded = (
            from_gguf(path)
            if path.suffix == ".gguf"
            else TokenizerFile(Tokenizer.from_file(str(path)))
        )
    except Exception as exc:  # the libraries raise their own kinds
        raise ConfigError(f"tokenizer {path}: cannot be read: {exc}") from None
    _LOADED[path] = loaded
    return loaded


def from_gguf(path: Path) -> TokenizerFile:
    """The byte-level BPE tokenizer (GGUF's `gpt2` kind: Llama 3, Qwen, SmolLM...) of a GGUF
    model, from its vocabulary, merges and control tokens, with its chat template."""
    from gguf import GGUFReader
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    fields = GGUFReader(str(path)).fields

    def strings(name: str) -> list[str]:
        field = fields[name]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(name: str) -> Any:
        field = fields.get(name)
        return None if field is None else field.parts[-1][0]

    kind = bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer kind {kind!r}: only byte-level BPE ('gpt2') is read")
    tokens = strings("tokenizer.ggml.tokens")
    merges = [(a, b) for a, _, b in (m.partition(" ") for m in strings("tokenizer.ggml.merges"))]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    kinds = fields["tokenizer.ggml.token_type"]
    control = [tokens[n] for n, i in enumerate(kinds.data) if int(kinds.parts[i][0]) == 3]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    loaded = TokenizerFile(tokenizer)
    if "tokenizer.chat_template" in fields:
        source = bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        loaded.template = env.from_string(source)
    bos, eos = scalar("tokenizer.ggml.bos_token_id"), scalar("tokenizer.ggml.eos_token_id")
    loaded.eos = "" if eos is None else tokens[int(eos)]
    if bos is not None and bool(scalar("tokenizer.ggml.add_bos_token")):
        loaded.bos = tokens[int(bos)]
    return loaded
