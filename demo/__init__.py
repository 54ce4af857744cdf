"""radixkv demo: a chat page and an OpenAI-compatible server with prefix reuse (python -m demo)."""
