"""The prompt side of an engine: chat templates, tokenising and decoding, with no model.

Shared by demo.engine.engine.Engine (in-process) and demo.api.engine_client.RemoteEngine (a
front end's process, where the text work happens when the engine core runs apart).
"""

from __future__ import annotations

from collections.abc import Sequence

from demo.model import chat_tokens, vision
from demo.model.loading import CHAT_TEMPLATE


class Prompts:
    """Chat prompts to token ids and ids to text, for one tokenizer (and a VLM's processor)."""

    snapshots = False  # the store keeps recurrent-state snapshots (Engine: from its store)

    def __init__(self, tokenizer, processor=None, snapshots: bool | None = None):
        self.tokenizer, self.processor = tokenizer, processor
        if snapshots is not None:
            self.snapshots = snapshots
        # Special tokens decoding drops, and the markers of them kept (keep_special)
        self._special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self._special |= set(tokenizer.all_special_ids)
        self._keep: set[int] = set()

    def chat_ids(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn; control tokens inside
        message contents are plain text (demo.model.chat_tokens). ``tools`` and
        ``template_kwargs`` go to the chat template. Raises ValueError. A vision-language
        model's chats are rendered by its processor (demo.model.vision), images or not."""
        if self.processor is not None:
            if tools or template_kwargs:
                raise ValueError(
                    "tools and chat_template_kwargs are not supported with a vision-language model"
                )
            return vision.render(self.processor, list(messages), []).ids
        return chat_tokens.chat_ids(self.tokenizer, list(messages), self.template(), tools, template_kwargs)

    def message_ends(
        self,
        messages: Sequence[dict],
        ids: Sequence[int],
        tools: Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int] | None:
        """Snapshot hints for a chat prompt (``chat_tokens.message_ends``): only for a text model
        whose store keeps recurrent-state snapshots (its cache reuses a prompt only where one was
        taken), else None."""
        if not self.snapshots or self.processor is not None:
            return None
        messages = list(messages)
        return chat_tokens.message_ends(
            self.tokenizer, messages, self.template(), ids, tools, template_kwargs
        )

    def template(self) -> str | None:
        """The chat template passed to apply_chat_template: None for the tokenizer's own, the
        demo's CHAT_TEMPLATE for a tokenizer without one."""
        return None if getattr(self.tokenizer, "chat_template", None) else CHAT_TEMPLATE

    def keep_special(self, markers: Sequence[str]) -> None:
        """Keep these marker tokens (reasoning and tool-call tags) in decoded replies even when
        the tokenizer counts them as special tokens, which decoding otherwise drops."""
        self._keep = {i for i, t in self.tokenizer.added_tokens_decoder.items() if t.content in markers}

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        if not self._keep:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        kept = [i for i in ids if i in self._keep or i not in self._special]
        return self.tokenizer.decode(kept, skip_special_tokens=False)
