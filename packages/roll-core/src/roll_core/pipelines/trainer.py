"""The training side of every pipeline: from a collected batch to new weights in the inference engines.

`Trainer.update(step, collected, log)` hands engines that share devices with training to it (they sleep) and
runs the pipeline's objective (roll_core.pipelines.objectives: RL, SFT, DPO, distillation; none for rollout-only
runs), then counts the streak of non-finite steps and the longest streak of fp16 loss-scaler skips its roles
report (`*/scaler_skip_streak_max`). `Trainer.sync_weights(collector, log)` wakes sleeping engines,
lets the collector pause or abort its requests, pushes the weights and tells the collector the new version;
`stale` says whether the engines hold older weights than the actor (collectors that do not generate from the
policy every step sync only before they evaluate).

Must not generate or score: that is the collector's side. Owns the train-side checkpoint state (actor, critic,
objective) and the streaks (the loop stops the run on them: pipeline.max_nonfinite_steps, max_loss_scale_skips).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from roll_core.cluster.weight_sync import WeightSync
from roll_core.config.schema import RLVRConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.exported_stops import export_stop_tokens
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import Objective
from roll_core.pipelines.wiring import Roles

log = logging.getLogger(__name__)


class SyncListener(Protocol):
    """What the trainer tells a collector around a weight sync (roll_core.pipelines.collectors.Collector)."""

    def begin_sync(self) -> None: ...

    def finish_sync(self, version: int) -> None: ...


class Trainer:
    """Roles of the training side, the objective's update and the weight sync (see the module docstring)."""

    def __init__(self, cfg: RLVRConfig, roles: Roles, objective: Objective, *, placement: str, platform: Any) -> None:
        ie = cfg.infer_engine
        self.cfg, self.roles, self.objective = cfg, roles, objective
        # Rollout-only runs train nothing: no actor, nothing to push.
        self.weight_sync = (
            WeightSync(
                roles.actor_train,
                roles.actor_infer,
                transport=ie.sync_transport,
                bucket_mb=ie.sync_bucket_mb,
                placement=placement,
                timeout_s=ie.sync_timeout_s,
                platform=platform,
            )
            if roles.actor_train is not None
            else None
        )
        self.sleep_level = int(ie.sleep_level) if roles.actor_train is not None else 0
        self.version = 0  # weight updates pushed to the engines
        self.stale = False  # the actor changed since the last push
        self.asleep = False  # the engines sleep (sleep_level > 0) from an update to the next sync
        self.bad_steps = 0  # consecutive steps whose optimizer steps were all skipped for NaN/inf
        # The longest run of optimizer steps in a row that fp16's loss scaler skipped, as of the last update (0
        # without fp16); the engines carry it across steps, so a step with one optimizer step still counts it.
        self.scaler_streak = 0

    @property
    def trains(self) -> bool:
        """False for rollout-only runs (no actor)."""
        return self.roles.actor_train is not None

    # ---- the update ---------------------------------------------------------------------------------------
    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        """Run the objective on `collected`; metrics go to `out`."""
        if not self.trains:
            self.objective.update(step, collected, out)
            return
        self._give_devices_to_training()
        self.objective.update(step, collected, out)
        self.stale = True
        # A step counts only when none of its optimizer steps applied: one skipped mini-batch of four is not a
        # blow-up (the other three trained, and the step's checkpoint is as healthy as any).
        skipped_all = out.get("actor/nonfinite_steps", 0.0) > 0 and out.get("actor/optimizer_steps", 0.0) == 0
        self.bad_steps = self.bad_steps + 1 if skipped_all else 0
        # (actor/, critic/ and AsyPPO's critic_<m>/ engines each keep their own scaler)
        streaks = [v for k, v in out.items() if k.endswith("/scaler_skip_streak_max")]
        self.scaler_streak = int(max(streaks, default=0))

    # ---- engines around the update ------------------------------------------------------------------------
    def _give_devices_to_training(self) -> None:
        """Engines that share devices with training sleep until the next weight sync."""
        if self.sleep_level and not self.asleep:  # objectives that skip syncs update several times between wakes
            self.roles.actor_infer.sleep(self.sleep_level)
            self.asleep = True
            if self.sleep_level == 2:  # the weights were dropped: the next sync sends all of them
                self.weight_sync.require_full()

    def sync_weights(self, collector: SyncListener, out: StepLog) -> None:
        """Push the trained weights to the engines; the collector pauses (or aborts) its requests around it."""
        if self.weight_sync is None:
            return
        with out.timer("sync"):
            if self.asleep:
                self.roles.actor_infer.wake_up()
                self.asleep = False
            collector.begin_sync()
            metrics = self.weight_sync.sync().metrics()
            self.version += 1
            # The run's count: an engine's own restarts with its process (a resumed run's engines count from 0).
            metrics["sync/weight_version"] = float(self.version)
            out.update(metrics)
            self.stale = False
            collector.finish_sync(self.version)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save(self, folder: Path, tokenizer_path: str) -> dict[str, Any]:
        """Write the actor (and critic) under `folder`; returns the trainer's state for state.json. The actor's
        exported `model/` stops where the run's engines stopped: model.stop_tokens join its generation config's eos
        ids (roll_core.pipelines.exported_stops)."""
        if self.roles.actor_train is not None:
            self.roles.actor_train.save(str(folder / "actor"), tokenizer_path)
            model = self.cfg.model
            export_stop_tokens(folder / "actor" / "model", model.stop_tokens, model.trust_remote_code)
        for name, critic in self._critics():
            critic.save(str(folder / name), tokenizer_path)
        # The RL objective's state sits at the top level ("kl"), where checkpoints before objectives kept it.
        return {**self.objective.state_dict(), "version": self.version}

    def _critics(self) -> list[tuple[str, Any]]:
        """(checkpoint folder, group) of every critic: `critic`, then AsyPPO's further ones `critic_1`, ..."""
        groups = self.roles.critics or ([self.roles.critic] if self.roles.critic is not None else [])
        return [("critic" if m == 0 else f"critic_{m}", g) for m, g in enumerate(groups)]

    def restore(self, folder: Path, state: dict[str, Any]) -> None:
        """Load what `save` wrote and push every weight to the engines."""
        if self.roles.actor_train is not None:
            self.roles.actor_train.load(str(folder / "actor"))
        for name, critic in self._critics():
            critic.load(str(folder / name))
        self.objective.load_state_dict(state)
        self.version = int(state.get("version", 0))
        if self.weight_sync is not None:
            self.weight_sync.sync(full=True)
