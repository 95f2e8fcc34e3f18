"""Asynchronous rollout: scheduling (pure), routing over engines that leave and rejoin (`pool`: partial-GPU mode) and
the driver over real engines (the cluster simulator that drives them at scale lives in bench/async_sim)."""
