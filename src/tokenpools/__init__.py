"""tokenpools: token-pool admission control for multi-tenant LLM inference."""

__version__ = "0.1.0"
