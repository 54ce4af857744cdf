"""Checkpoints the adapter and image tests serve, saved by the tests (no hub): LoRA adapters over
the built-in tiny model (peft, random init so that they change the output) and a tiny LLaVA with
its processor (CLIP image processor + the built-in tokenizer with an <image> token + a chat
template), plus their offline stock counterparts."""

from __future__ import annotations

import base64
import io

import torch

from demo.model.loading import build_builtin, build_tokenizer, unreadable_ids

# Renders string contents and content-part lists alike (text parts, image parts as <image>).
VLM_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
IMAGE_TOKENS = 16  # a 32x32 image in 8x8 patches (the CLS feature dropped)


def save_adapter(path, seed: int, model: str = "builtin-tiny", **lora) -> str:
    """A LoRA adapter with random A and B (init_lora_weights=False) over ``model``, saved as peft does."""
    from peft import LoraConfig, get_peft_model

    base, _ = build_builtin(model)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
        **lora,
    )
    get_peft_model(base, config).save_pretrained(str(path))
    return str(path)


def peft_reference(adapter_path: str | None, model: str = "builtin-tiny"):
    """(model, tokenizer): a fresh built-in model with the adapter loaded by peft (None: the base)."""
    from peft import PeftModel

    base, tokenizer = build_builtin(model)
    if adapter_path is None:
        return base, tokenizer
    return PeftModel.from_pretrained(base, adapter_path).eval(), tokenizer


def stock_reply(model, tokenizer, prompt_ids: list[int], max_new: int, **inputs) -> tuple[list[int], str]:
    """Stock greedy generate() (no cache) of ``prompt_ids``: (reply ids, reply text)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        **inputs,
    )
    reply = out[0, len(prompt_ids) :].tolist()
    return reply, tokenizer.decode(reply, skip_special_tokens=True)


def save_vlm(path, seed: int = 0) -> str:
    """A tiny LLaVA (CLIP tower 32x32 / patch 8, the built-in tiny language model's shape) with
    its processor and chat template, saved as a checkpoint directory."""
    from transformers import AutoConfig, CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = build_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VLM_TEMPLATE,
        image_token="<image>",
    )
    text = dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=0.3,
    )  # fmt: skip
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = AutoConfig.for_model(
        "llava", text_config=text, vision_config=vision, image_token_id=image_token, vision_feature_layer=-1
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.suppress_tokens = [*unreadable_ids(tokenizer), image_token]
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return str(path)


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A PNG of random pixels (width x height ``size``) drawn from ``seed``."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"


def pil(raw: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(raw)).convert("RGB")


# A chat template with tools (Hermes-style <tool_call> blocks, tool results as user turns) and
# opt-in thinking (enable_thinking opens a <think> block in the generation prompt).
AGENT_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call functions. Signatures:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Answer a call as <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|end|>'
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n</tool_response><|end|>"
    "{%- else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)
# The parameters of an `add` tool, as the agent tests declare it (chat and Responses shapes).
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}

AGENT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def save_agent_model(path, seed: int = 0, name: str = "builtin-tiny") -> str:
    """The built-in (tiny) model with a tool-calling, thinking chat template and its markers as
    added (non-special) tokens, as Qwen's checkpoints have them, saved as a checkpoint directory."""
    model, tokenizer = build_builtin(name)
    tokenizer.add_tokens(AGENT_TOKENS)
    tokenizer.chat_template = AGENT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            new = model.get_input_embeddings().weight[-len(AGENT_TOKENS) :]
            new.normal_(0, 0.3)
    model.generation_config.suppress_tokens = unreadable_ids(tokenizer)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)
