"""Asynchronous rollout: scheduling (pure) and the driver over real engines (the cluster simulator that drives the
scheduler at scale lives in bench/async_sim)."""
