"""Multi-turn (agentic) rollout: token-in-token-out trajectories, env managers, the rollout loop."""
