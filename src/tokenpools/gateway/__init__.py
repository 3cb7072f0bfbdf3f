"""The OpenAI-compatible admission gateway: every request is admitted or shed by the decision
core before it reaches a backend, and settled from the backend's usage when it ends."""
