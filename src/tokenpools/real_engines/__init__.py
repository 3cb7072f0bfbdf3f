"""Real inference engines to put behind the gateway: llama.cpp (in CI) and vLLM (optional)."""
