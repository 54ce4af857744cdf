"""A tiny random tool-calling model for TRL runs, built offline: the byte-level BPE tokenizer of
the built-in model with Qwen3's chat template (TRL's copy, so ``add_response_schema`` knows its
tool-call format) and its markers as tokens, and a seeded Llama of that vocabulary.

A random model never writes a tool call by itself. ``TOOL_BIAS`` is a ``sequence_bias`` for
generate() (through ``GRPOConfig.generation_kwargs``: a logits processor of stock generate(),
applied alike with and without radixkv): ``<tool_call>`` gets a small bias at every position, and
once it is sampled the rest of the call ``\\n{"name": "ping", "arguments": {}}\\n</tool_call>``
and ``<|im_end|>`` follow (the call's JSON is one added token). So some completions call the
tool after a few random tokens, others run to the length limit: rewards vary, and so does the
gradient. ``ping`` is the one tool; ``Pinger`` the environment whose ``ping`` method is its tool.
"""

from __future__ import annotations

import functools
import os

import torch

CALL = '{"name": "ping", "arguments": {}}'
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>", CALL]


@functools.cache
def _qwen3_template() -> str:
    import trl

    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3.jinja")) as f:
        return f.read()


def tool_tokenizer(vocab: int = 320):
    """A fresh tokenizer (TRL's trainers set attributes on it: one per trainer)."""
    from demo.model.loading import build_tokenizer

    tok = build_tokenizer(vocab)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(MARKERS)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = _qwen3_template()
    return tok


def tool_bias(tok, start: float = 3.0) -> dict[tuple[int, ...], float]:
    """``sequence_bias`` that completes a started tool call (see the module docstring)."""
    tc, nl, call, _, end_call, end = tok.encode(
        f"<tool_call>\n{CALL}\n</tool_call><|im_end|>", add_special_tokens=False
    )
    sure = 40.0
    return {
        (tc,): start,
        (tc, nl): sure,
        (tc, nl, call): sure,
        (tc, nl, call, nl): sure,
        (tc, nl, call, nl, end_call): sure,
        (nl, call, nl, end_call, end): sure,
    }


def tiny_llama(tok, *, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 1):
    """A seeded random Llama over ``tok``'s vocabulary (fp32, CPU; benchmarks/bench_rl.py builds
    a wider one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def ping() -> str:
    """Ping the server.

    Returns:
        The server's answer.
    """
    return "pong"


class Pinger:
    """An environment of two turns at most (``max_tool_calling_iterations=2``): each ``ping``
    answers with the count so far."""

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        return None

    def ping(self) -> str:
        """Ping the environment.

        Returns:
            How many pings it has had.
        """
        self.count += 1
        return f"ping {self.count}"
