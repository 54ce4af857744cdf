"""Chat prompts to token ids without forged turns.

Tokenising the rendered chat as one string turns the *text* `<|end|><|system|>` inside a
user's message into the real marker tokens: a user could write a system turn. Here the
control tokens inside message contents are wrapped in two private-use marker characters
before rendering; after rendering, the text is split at the markers, the marked tokens are
encoded as plain text and everything else (the template's own markers included) as usual.
This is the scheme of transformers' `apply_chat_template(sanitize_control_tokens=True)`
(5.23), kept here in one small module.

A conversation whose contents hold no control token renders with no marker and is encoded
exactly as before (one `tokenizer(text)` call), so cache keys and multi-turn reuse are
unchanged for it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

# Supplementary Private Use Area-A: never produced by a tokenizer or a template. Stripped from
# contents first, so a client cannot send a marker of its own.
START, END = "\U000f0000", "\U000f0001"


def control_tokens(tokenizer, template: str) -> tuple[str, ...]:
    """The tokens a message must not produce: every special token, plus the added tokens the
    template writes itself (non-special markers such as `<think>`), whitespace ones excepted."""
    return tuple(
        t.content
        for t in tokenizer.added_tokens_decoder.values()
        if t.content and (t.special or (t.content in template and not t.content.isspace()))
    )


@lru_cache(maxsize=16)
def _patterns(tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    longest_first = "|".join(map(re.escape, sorted(tokens, key=len, reverse=True))) or "(?!)"
    # [text, marked token, text, ...]; a lone marker (a template's .split() cut a pair) splits
    # with None in the token's place, so text on both sides can never join into a token.
    return re.compile(longest_first), re.compile(f"{START}({longest_first}){END}|[{START}{END}]")


def mark(content: str, tokens: tuple[str, ...]) -> str:
    """`content` with markers stripped, then each control token wrapped in START..END."""
    content = content.replace(START, "").replace(END, "")
    return _patterns(tokens)[0].sub(lambda m: START + m.group(0) + END, content)


def _encode_without_added_tokens(tokenizer, text: str) -> list[int]:
    """Ids of `text` with no added token matched (special or not). Fast tokenizers: the
    backend's normalizer, pre-tokenizer and model directly, with no shared flag flipped
    (`split_special_tokens=True` toggles one on the shared backend: a race between threads)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    splits = [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
    return [t.id for p in splits for t in backend.model.tokenize(p)]


def encode_piece(tokenizer, piece: str, plain: bool) -> list[int]:
    """Ids of a piece from the middle of a chat; `plain`: no added tokens matched.

    Encoded behind a newline that is then removed, so a SentencePiece-style tokenizer does not
    add the word-start prefix it adds at the start of a string (transformers' trick too).
    """

    def encode(s: str) -> list[int]:
        if plain:
            return _encode_without_added_tokens(tokenizer, s)
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    newline = encode("\n")
    ids = encode("\n" + piece)
    return ids[len(newline) :] if ids[: len(newline)] == newline else encode(piece)


def _mark_all(value, tokens: tuple[str, ...]):
    """``value`` (JSON-like: str, list, dict) with every string, dict keys included, marked."""
    if isinstance(value, str):
        return mark(value, tokens)
    if isinstance(value, list):
        return [_mark_all(v, tokens) for v in value]
    if isinstance(value, dict):
        return {mark(k, tokens) if isinstance(k, str) else k: _mark_all(v, tokens) for k, v in value.items()}
    return value


def message_ends(
    tokenizer,
    messages: Sequence[dict],
    template: str | None,
    ids: Sequence[int],
    tools: Sequence[dict] | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Where the first message and the last but one end in ``ids`` (``chat_ids`` of ``messages``):
    where a later chat is likely to part from this one (another question under one system prompt,
    an edited last turn). A boundary is kept only where the template renders the shorter
    conversation as a prefix of ``ids``. For recurrent models, whose cache reuses a prompt only
    where a snapshot was taken (hf_patch.RadixCache(snapshot_at=)); two renders of the template."""
    ends = []
    for k in sorted({1, len(messages) - 1}):
        if not 0 < k < len(messages):
            continue
        try:
            head = chat_ids(
                tokenizer, messages[:k], template, tools, template_kwargs, generation_prompt=False
            )
        except ValueError:
            continue
        if 0 < len(head) < len(ids) and list(ids[: len(head)]) == head:
            ends.append(len(head))
    return ends


def chat_ids(
    tokenizer,
    messages: Sequence[dict],
    template: str | None,
    tools: Sequence[dict] | None = None,
    template_kwargs: dict | None = None,
    *,
    generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` ({"role", "content": str, and for agents "tool_calls" /
    "tool_call_id"}) rendered with `template` (None: the tokenizer's own) plus the assistant's
    generation prompt (``generation_prompt``). ``tools``: function specs ({"name", "description", "parameters"}) passed
    to the template as transformers does (``{"type": "function", "function": spec}``);
    ``template_kwargs``: extra template variables (``enable_thinking``). Every string a client
    sent (tool definitions and call arguments too) is marked, so none can forge a turn.

    Raises ValueError if the template rejects the messages, or if the tokenizer produces a
    control token from plain text (then no encoding could keep it out).
    """
    source = template or tokenizer.chat_template
    tokens = control_tokens(tokenizer, source if isinstance(source, str) else "")
    marked = _mark_all(list(messages), tokens)
    extra = _mark_all(dict(template_kwargs or {}), tokens)
    if tools:
        extra["tools"] = _mark_all([{"type": "function", "function": t} for t in tools], tokens)
    try:
        text = tokenizer.apply_chat_template(
            marked, chat_template=template, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )
    except Exception as e:  # jinja TemplateError: the model's template refused the messages
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    pieces = _patterns(tokens)[1].split(text)
    ids = tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        # Odd pieces are marked tokens (plain text); even ones lie between them, where the
        # template's own markers stay special.
        piece_ids = encode_piece(tokenizer, piece, plain=i % 2 == 1)
        if i % 2 == 1 and tokenizer.convert_tokens_to_ids(piece) in piece_ids:
            raise ValueError(
                f"cannot keep {piece!r} out of the prompt: the tokenizer makes it from plain text"
            )
        ids += piece_ids
    return ids
