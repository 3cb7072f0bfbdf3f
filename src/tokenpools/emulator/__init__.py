"""An OpenAI-compatible server driven by the engine model in real time: a stand-in for vLLM."""
