"""A deterministic discrete-event simulator: tenants, workloads and an engine model in virtual
time, with admission decided by a policy — the decision core itself, or a baseline."""
