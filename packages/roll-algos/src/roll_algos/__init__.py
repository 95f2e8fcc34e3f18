"""roll-algos: the RL math for LLM post-training, on plain torch tensors.

Modules: `advantages` (GRPO, Dr.GRPO, RLOO, REINFORCE++, REINFORCE++-baseline, GAE, returns, whitening),
`losses` (policy-loss variants, value loss, aggregation, entropy, off-policy weights, overlong penalty),
`kl` (k1/k2/k3/abs estimators, fixed and adaptive controllers), `sft` (NLL), `preference` (DPO, IPO, SLiC hinge,
SimPO and their row weights), `distill` (top-k KL to a teacher, on-policy distillation advantages), `asyppo`
(AsyPPO's critic shards, ensemble value and disagreement masks), `schedules` (the LR schedule's multiplier: warm-up,
then constant, linear or cosine decay).
No Ray, no configs, no batch classes.
"""

from roll_algos import advantages, asyppo, distill, kl, losses, preference, schedules, sft

__version__ = "0.1.0"
__all__ = ["advantages", "asyppo", "distill", "kl", "losses", "preference", "schedules", "sft"]
