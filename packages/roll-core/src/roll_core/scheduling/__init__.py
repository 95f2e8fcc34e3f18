"""Asynchronous rollout: scheduling (pure), the driver over real engines, and a cluster simulator."""
