"""The model and tokenizer the demo serves: a built-in random model, a local checkpoint
directory, or a Hugging Face Hub id (downloaded as `from_pretrained` does).

The built-in model needs no download: a Llama-architecture network with seeded random
weights and a byte-level BPE tokenizer trained at start-up on a text that ships here. Both
are deterministic (same weights, same vocabulary on every machine), so its replies are
noise, but the *same* noise every time: what it shows is time to first token and
prefix reuse, not language.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Prefix-stable across turns: the prompt of turn n is a prefix of the prompt of turn n+1
# (the answer plus <|end|> is appended), so a multi-turn chat reuses its own history.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class BuiltinSpec:
    """Size of a built-in model. `context` is max_position_embeddings."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int


BUILTIN = {
    # ~20M parameters: a 2,000-token prompt takes about a second on two CPU cores.
    "builtin": BuiltinSpec(
        hidden=512, layers=6, heads=8, kv_heads=4, intermediate=1408, vocab=2048, context=4096
    ),
    # For tests: starts in well under a second.
    "builtin-tiny": BuiltinSpec(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, context=1024
    ),
}

_WORDS = (
    "the a an of to in and or is are was be cache prefix token block tree node pool key value "
    "model request reply prompt chat table row column name age city job question answer time "
    "first second long short fast slow reuse memory server client stream user assistant system "
    "hello world this that with from for on by as it we you they what which who when where how "
    "Alice Bruno Chen Dara Elif Farid Greta Hugo Ines Jonas Kenji Lena Mateo Nadia Omar Priya "
    "Berlin Lagos Lima Osaka Paris Porto Quito Rome Seoul Tunis Vienna Zagreb "
    "baker doctor engineer farmer lawyer nurse pilot teacher writer"
).split()


def builtin_corpus(num_sentences: int = 3000) -> list[str]:
    """A deterministic pseudo-English text (fixed LCG, no global RNG) to train the BPE on."""
    state, out = 12345, []
    for _ in range(num_sentences):
        words = []
        for _ in range(4 + state % 9):
            state = (state * 1103515245 + 12345) % 2**31
            words.append(_WORDS[(state >> 8) % len(_WORDS)])
        state = (state * 1103515245 + 12345) % 2**31
        out.append(" ".join(words) + f" | {state % 100} |.\n")
    return out


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` with the chat special tokens and template.

    Any text encodes (the 256 byte symbols are in the vocabulary); training is
    deterministic for a fixed corpus and vocab_size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>", model_max_length=10**6
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_builtin(name: str = "builtin", device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for a BUILTIN spec; weights seeded, so identical on every machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = BUILTIN[name]
    tokenizer = build_tokenizer(spec.vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate,
        max_position_embeddings=spec.context,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
        # At the usual 0.02 a random model's greedy output repeats one token; wider weights
        # give varied noise, so a cache that changed a logit would show up as changed text.
        initializer_range=0.3,
    )
    # A private generator keeps the caller's global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.suppress_tokens = unreadable_ids(tokenizer)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def unreadable_ids(tokenizer) -> list[int]:
    """Ids a random model should not emit: chat markers and lone bytes that decode to no
    printable text (control bytes, halves of UTF-8 sequences). Keeps its noise legible."""
    out, special = [], set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS))
    for i in range(len(tokenizer)):
        if i == tokenizer.eos_token_id:
            continue
        text = tokenizer.decode([i])
        if (
            i in special
            or not text
            or "\ufffd" in text
            or not all(c.isprintable() or c == "\n" for c in text)
        ):
            out.append(i)
    return out


class ModelNotFound(ValueError):
    """--model names no built-in model, no local directory and nothing loadable from the Hub."""


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded; the defaults are from_pretrained's own.

    revision: a branch, tag or commit of a Hub repository (ignored for a local directory).
    trust_remote_code: run the repository's own modelling code; off unless asked for.
    device_map: passed to from_pretrained (accelerate places the layers, e.g. "auto" over
        several GPUs and the CPU); the model is then not moved to `device` afterwards.
    """

    revision: str | None = None
    trust_remote_code: bool = False
    device_map: str | None = None


def load_pretrained(name_or_path: str, device: str, dtype: torch.dtype, options: LoadOptions = LoadOptions()):
    """(model, tokenizer, processor) from a local checkpoint directory (never downloads) or a Hub
    id. ``processor``: a vision-language checkpoint's (demo.model.vision), else None.

    Raises ModelNotFound when neither is there (no such repository or revision, no network).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from demo.model import vision

    local = os.path.isdir(name_or_path)
    kwargs: dict = {"trust_remote_code": options.trust_remote_code}
    if local:
        kwargs["local_files_only"] = True
    elif options.revision is not None:
        kwargs["revision"] = options.revision
    model_kwargs = {**kwargs, "dtype": dtype}
    if options.device_map is not None:
        model_kwargs["device_map"] = options.device_map
    processor = None
    try:
        config = AutoConfig.from_pretrained(name_or_path, **kwargs)
        if vision.is_vision_config(config):
            model, processor = vision.load(name_or_path, config, kwargs, model_kwargs)
            tokenizer = processor.tokenizer
        else:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, **model_kwargs)
    except OSError as e:  # transformers' wording for: no such repo / file / revision, offline
        where = "the local directory" if local else "the Hugging Face Hub"
        raise ModelNotFound(f"cannot load {name_or_path!r} from {where}: {e}") from None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if options.device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer, processor


def load_local(path: str, device: str, dtype: torch.dtype):
    """(model, tokenizer, processor) from a local HuggingFace checkpoint directory; never downloads."""
    return load_pretrained(path, device, dtype)


def load(name_or_path: str, device: str, dtype: torch.dtype, options: LoadOptions = LoadOptions()):
    """Dispatch: a BUILTIN name, a local checkpoint path or a Hub id -> (model, tokenizer,
    processor or None). Raises ModelNotFound."""
    if name_or_path in BUILTIN:
        log.info("building %s model (random weights) on %s/%s", name_or_path, device, dtype)
        return (*build_builtin(name_or_path, device, dtype), None)
    log.info("loading %s on %s/%s (%s)", name_or_path, options.device_map or device, dtype, options)
    return load_pretrained(name_or_path, device, dtype, options)


def context_length(model, tokenizer) -> int:
    """Longest sequence (prompt + completion) the model accepts (a VLM's: its language model's)."""
    n = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0:
        return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**6 else 2048
