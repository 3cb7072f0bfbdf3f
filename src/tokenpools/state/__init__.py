"""The stores behind the decision core's port: `memory` (the embedded default) and `redis/`
(shared by gateway replicas)."""
