"""Kubernetes host: CRDs, the operator (virtual nodes as their own kubelet, lease pods,
autoscaling), and the cluster as a config source for the gateway."""
