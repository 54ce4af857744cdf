"""What the demo serves: ``loading`` (a built-in random model, a local checkpoint or a Hub id),
``adapters`` (PEFT LoRA adapters as extra model names), ``vision`` (a vision-language
checkpoint's processor and chat template) and ``chat_tokens`` (chat prompts to ids without
forged turns)."""
