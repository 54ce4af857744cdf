"""demo.engine.textstream past its first 2 x WINDOW ids: the text is read through a window (the
ids since the last anchor plus CONTEXT before it), not a decode of every id. The deltas it
releases must be those of decoding every id at each push (the stream before the window), for
the tokenizers library's decoders (byte-level BPE, SentencePiece's metaspace, Llama 2's byte
fallback, WordPiece, transformers' space clean-up), with special tokens skipped and stop
strings; a decoder the window cannot reproduce falls back to decoding every id."""

from __future__ import annotations

import random

import pytest

from demo.engine.textstream import TextStream
from demo.model.loading import SPECIAL_TOKENS, build_tokenizer, builtin_corpus


class WholeStream(TextStream):
    """The stream before the window: every push decodes every id."""

    def _full(self) -> str:
        return self._decode(self._ids)


def _fast(tok, **kwargs):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=10**6, **kwargs)


def _trained(model, pre_tokenizer, decoder, trainer, texts: list[str]):
    """A tokenizer of ``model`` trained on the built-in corpus and ``texts`` (600 ids, the
    chat specials)."""
    from tokenizers import Tokenizer

    tok = Tokenizer(model)
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    tok.train_from_iterator(
        builtin_corpus(400) + texts,
        trainer=trainer(vocab_size=600, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False),
    )
    return _fast(tok, unk_token="<unk>")


def _metaspace():
    """SentencePiece-like: "▁" marks a word's space; the decoder drops the first one."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    return _trained(
        models.BPE(unk_token="<unk>"),
        pre_tokenizers.Metaspace(),
        decoders.Metaspace(),
        trainers.BpeTrainer,
        ["é ✓ ß"],
    )


def _byte_fallback():
    """Llama 2's decoder chain: byte tokens <0xNN> fused into characters, a leading space stripped."""
    from tokenizers import Tokenizer, decoders, models

    words = ["▁the", "▁cache", "▁é", "▁prefix", "ab", "▁", "✓", "."]
    vocab = {
        t: i for i, t in enumerate(["<unk>", *SPECIAL_TOKENS, *words, *(f"<0x{b:02X}>" for b in range(256))])
    }
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return _fast(tok, unk_token="<unk>")


def _wordpiece():
    from tokenizers import decoders, models, pre_tokenizers, trainers

    return _trained(
        models.WordPiece(unk_token="<unk>"),
        pre_tokenizers.Whitespace(),
        decoders.WordPiece(),
        trainers.WordPieceTrainer,
        ["x ' y don ' t it ' s"] * 5,
    )


def _cleanup():
    """WordPiece with transformers' clean-up: " ." becomes "." (it rewrites the text before a
    new id; transformers applies it to WordPiece decoders only)."""
    tok = _wordpiece()
    tok.clean_up_tokenization_spaces = True
    return tok


TOKENIZERS = {
    "byte-level": lambda: build_tokenizer(512),
    "metaspace": _metaspace,
    "byte-fallback": _byte_fallback,
    "wordpiece": _wordpiece,
    "clean-up": _cleanup,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def _ids(tok, rng: random.Random, n: int) -> list[int]:
    """n ids: mostly whole words of a text (as a model writes), some random ids (bytes split
    inside characters, odd pieces), some special tokens."""
    words = tok.encode(" ".join(builtin_corpus(60)) + " é ✓ . , ok", add_special_tokens=False)
    special = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.7:
            start = rng.randrange(len(words))
            out += words[start : start + rng.randrange(1, 12)]
        elif r < 0.95:
            out.append(rng.randrange(len(tok)))
        else:
            out.append(rng.choice(special))
    return out[:n]


def _run(stream: TextStream, ids: list[int], rng: random.Random) -> list[str]:
    deltas, i = [], 0
    while i < len(ids) and not stream.stopped:
        n = rng.randrange(1, 4)  # a step streams 1 token; a resumed or n>1 row a few
        deltas.append(stream.push(ids[i : i + n]))
        i += n
    return [*deltas, stream.finish()]


@pytest.mark.parametrize("keep_special", [False, True])
def test_the_window_releases_what_decoding_every_id_releases(tokenizer, keep_special):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=not keep_special)  # noqa: E731
    for seed in range(4):
        ids = _ids(tokenizer, random.Random(seed), 700)
        windowed, whole = TextStream(decode), WholeStream(decode)
        got = _run(windowed, ids, random.Random(seed))
        assert got == _run(whole, ids, random.Random(seed)), (seed, keep_special)
        assert windowed.text == whole.text
        # the window was used throughout, never given up for decoding every id
        assert windowed._anchor > len(ids) - 2 * TextStream.WINDOW and not windowed._whole


def test_stop_strings_past_the_window_cut_where_decoding_every_id_cuts(tokenizer):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for seed in range(6):
        rng = random.Random(100 + seed)
        ids = _ids(tokenizer, rng, 600)
        text = decode(ids)
        # a stop string that first appears late (past the window's start), or one split
        # across pushes, or one never produced
        at = rng.randrange(len(text) // 2, len(text) - 4)
        stops = [text[at : at + rng.randrange(2, 5)], "never-in-this-text"]
        windowed, whole = TextStream(decode, stops), WholeStream(decode, stops)
        got = _run(windowed, ids, random.Random(seed))
        assert got == _run(whole, ids, random.Random(seed))
        assert windowed.stopped == whole.stopped and windowed.text == whole.text
        assert windowed.stopped and not any(s in windowed.text for s in stops)


def _anchored(tok, tail: list[int]) -> tuple[TextStream, WholeStream, list[int]]:
    """Streams pushed 2 x WINDOW word ids ending with ``tail``, one at a time: the window's
    first anchor is then right after ``tail``."""
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    words = tok.encode(" ".join(builtin_corpus(40)), add_special_tokens=False)
    ids = words[: 2 * TextStream.WINDOW - len(tail)] + tail
    windowed, whole = TextStream(decode), WholeStream(decode)
    for i in ids:
        assert windowed.push([i]) == whole.push([i])
    assert windowed._anchor == len(ids)
    return windowed, whole, words


def test_context_ids_with_no_text_are_not_a_context():
    """Special tokens (skipped) just before the anchor: the window would start at a new id,
    which a metaspace decoder decodes without its space ("▁cache" -> "cache")."""
    tok = _metaspace()
    special = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    windowed, whole, words = _anchored(tok, [special] * (4 * TextStream.CONTEXT + 2))
    assert windowed._context == ""  # no text as far back as the context is looked for
    for i in words[:20]:
        assert windowed.push([i]) == whole.push([i])
    assert windowed.text == whole.text and not windowed._whole


def test_a_byte_fallback_run_across_the_anchor_keeps_its_characters():
    """Emoji as byte tokens (4 each, fused as one run by Llama 2's decoder chain) around the
    first anchor, at every offset: a context starting inside a character would decode to
    U+FFFD alone and in the window, where the whole decode has the emoji (the reply was then
    garbled, and silent from the next check on)."""
    tok = _byte_fallback()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    word = tok.convert_tokens_to_ids("▁the")
    emoji = tok.encode("😀🎉", add_special_tokens=False)
    assert len(emoji) == 8
    for before in range(2 * TextStream.WINDOW - 12, 2 * TextStream.WINDOW + 2):
        ids = [word] * before + emoji * 3 + [word] * 150
        windowed, whole = TextStream(decode), WholeStream(decode)
        for i in ids:
            assert windowed.push([i]) == whole.push([i]), before
        assert windowed.finish() == whole.finish() and windowed.text == decode(ids)
        assert not windowed._whole and windowed._anchor > 2 * TextStream.WINDOW, before


def test_a_context_of_skipped_special_tokens_is_not_short_enough_for_the_clean_up_to_span():
    """WordPiece with clean-up, and special tokens (skipped) between "x" and "'": the ids before
    the anchor decode alone to "'" only, a suffix of the whole text, but the clean-up of " ' "
    spans from before them to the ids after the anchor ("x ' y" is "x'y" whole)."""
    tok = _cleanup()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    special = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    x, quote, y = (tok.convert_tokens_to_ids(t) for t in ("x", "'", "y"))
    assert decode([x, special, quote, y]) == "x'y"  # the clean-up this test is about
    words = tok.encode(" ".join(builtin_corpus(40)), add_special_tokens=False)
    mid = [x] + [special] * 5 + [quote]
    ids = words[: 2 * TextStream.WINDOW - len(mid)] + mid + [y] + words[:150]
    for stop in ((), (" 'q",)):
        windowed, whole = TextStream(decode, stop), WholeStream(decode, stop)
        for i in ids:
            assert windowed.push([i]) == whole.push([i]), stop
        assert windowed.finish() == whole.finish() and windowed.text == whole.text
        assert not windowed._whole


def test_new_ids_that_rewrite_the_context_are_read_whole():
    """WordPiece with clean-up: "." after a space-separated word rewrites " ." to "."."""
    tok = _cleanup()
    word, dot = tok.convert_tokens_to_ids("the"), tok.convert_tokens_to_ids(".")
    windowed, whole, words = _anchored(tok, [word])
    assert tok.decode([word, dot]) == "the."  # the clean-up this test is about
    for i in [dot, word, dot, *words[:20]]:
        assert windowed.push([i]) == whole.push([i])
    assert windowed.text == whole.text and not windowed._whole


def test_a_decoder_the_window_cannot_reproduce_falls_back_to_decoding_every_id():
    """A decoder that rewrites the start of the text once it passes 300 ids (nothing real does
    this): the window cannot see it, its text stops matching a whole decode at the next anchor,
    and from then on the stream decodes every id (it releases what decoding every id releases)."""

    def decode(ids):
        text = "".join(chr(97 + i % 26) for i in ids)
        return text.upper() if len(ids) > 300 else text

    ids = list(range(1, 500))
    s = TextStream(decode)
    for i in ids:
        s.push([i])
        if s._whole:
            break
    assert s._whole and 300 < len(s._ids) <= 300 + TextStream.WINDOW
    reference = WholeStream(decode)
    reference._ids, reference.text = list(s._ids), s.text
    rest = ids[len(s._ids) :]
    assert [s.push([i]) for i in rest] == [reference.push([i]) for i in rest]


def test_a_long_reply_decodes_a_window_per_push_not_every_id():
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids if i < 10_000)  # ids >= 10,000: no text

    s = TextStream(decode)
    for i in range(4000):
        s.push([i])
    assert s.finish() == "" and s.text == decode(list(range(4000)))
    # a whole decode per push would be 4000 * 4001 / 2 ~ 8M ids; the window: ids since the
    # anchor + CONTEXT, and a whole decode every WINDOW ids
    every_id = 4000 * 4001 / 2
    assert sum(decoded) < every_id / 10, sum(decoded)
    # where the window cannot be used (ids with no text: no context), no worse than before
    decoded.clear()
    s = TextStream(decode)
    for i in range(2000):
        s.push([10_000 + i])
    assert s.finish() == "" and s.text == ""
    assert sum(decoded) < 1.02 * 2000 * 2001 / 2 + 2000, sum(decoded)
