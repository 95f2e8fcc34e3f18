"""A training run that kills itself at a chosen point: `python kill_points.py [--cli] <point> <step> <signal>
<overrides...>`.

The run is the one `roll_core.testing.run_pipeline` builds from the overrides (with `--cli`: `roll-train` with them,
its exit status and printed summary as a user gets them); at `<point>` of step `<step>` the
process sends itself `<signal>` (KILL: nothing of Python runs after it, as with the OOM killer or a preemption's
last word; TERM/INT: the run's own stop handling). Points (fault injection at the seams of the loop and of
roll_core.checkpoint, where a real kill lands between two writes):

- `build`: while the pipeline is built, once its roles are up (workers, engines, models loaded); `<step>` unused;
- `update`: at the start of the step's update (the batch collected, nothing trained yet);
- `eval`: inside the step's held-out evaluation (`eval_every`; step 0 is the evaluation before training);
- `save`: after the trainer wrote the step's weights into the staging folder, before state.json and the rename;
- `rename`: the staging folder complete and flushed (state.json in it), not yet renamed into place;
- `prune`: the step's checkpoint in place, the older ones beyond `keep_last` not yet deleted.

A point never reached leaves the run alone (it finishes; exit 0). On exit the run's summary is printed as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any


def _die(sig: signal.Signals) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)


def install(point: str, at: int, sig: signal.Signals) -> None:
    """Patch the loop so that `sig` is sent at `point` of step `at`."""
    from roll_core import checkpoint
    from roll_core.pipelines import loop
    from roll_core.pipelines.trainer import Trainer

    current = {"step": None}  # the step the loop is in (saves know their step; evaluations are told theirs)

    if point == "build":
        build_roles = loop.build_roles

        def killing_build_roles(*args: Any, **kwargs: Any) -> Any:
            roles = build_roles(*args, **kwargs)
            _die(sig)
            return roles

        loop.build_roles = killing_build_roles
    elif point == "update":
        update = Trainer.update

        def killing_update(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            if step == at:
                _die(sig)
            return update(self, step, *args, **kwargs)

        Trainer.update = killing_update  # type: ignore[method-assign]
    elif point == "eval":
        build = loop.Pipeline._build

        def build_then_wrap(self: Any, *args: Any, **kwargs: Any) -> None:
            build(self, *args, **kwargs)
            evaluate = self.collector.evaluate

            def killing_evaluate(step: int, *a: Any, **k: Any) -> Any:
                if step == at:
                    _die(sig)
                return evaluate(step, *a, **k)

            self.collector.evaluate = killing_evaluate

        loop.Pipeline._build = build_then_wrap  # type: ignore[method-assign]
    elif point == "save":
        save = Trainer.save

        def killing_save(self: Any, folder: Any, *args: Any, **kwargs: Any) -> Any:
            out = save(self, folder, *args, **kwargs)
            if folder.name == f"step_{at:06d}.tmp":
                _die(sig)
            return out

        Trainer.save = killing_save  # type: ignore[method-assign]
    elif point == "rename":
        fsync_tree = checkpoint.fsync_tree

        def killing_fsync_tree(root: Any, *args: Any, **kwargs: Any) -> None:  # (a rank's `include` too)
            fsync_tree(root, *args, **kwargs)
            if root.name == f"step_{at:06d}.tmp":
                _die(sig)

        checkpoint.fsync_tree = killing_fsync_tree
    elif point == "prune":
        commit = checkpoint.CheckpointManager.commit
        delete = checkpoint._delete

        def tracking_commit(self: Any, tmp: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            current["step"] = step
            return commit(self, tmp, step, *args, **kwargs)

        def killing_delete(folder: Any) -> None:
            if current["step"] == at:
                _die(sig)
            delete(folder)

        checkpoint.CheckpointManager.commit = tracking_commit  # type: ignore[method-assign]
        checkpoint._delete = killing_delete
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def main(argv: list[str]) -> None:
    cli = argv[:1] == ["--cli"]
    point, at, sig, *overrides = argv[1:] if cli else argv
    install(point, int(at), signal.Signals[f"SIG{sig}"])
    if cli:
        from roll_core.cli import train_main

        sys.argv = ["roll-train", *overrides]
        train_main()
        return
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from roll_core.testing import run_pipeline

    summary, _ = run_pipeline(overrides)
    print("SUMMARY " + json.dumps(summary, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
