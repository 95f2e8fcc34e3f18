"""curves.png's axes (roll_core.tracking.curve_figure): the step axis is ticked at whole steps (a three-step run's was
ticked 1.5, 2.5), and an accuracy panel spans 0..1 (a flat 0 spanned -0.04..0.04, a tiny change filled the panel)."""

from __future__ import annotations

import pytest

from roll_core.tracking import curve_figure

pytest.importorskip("matplotlib")


def test_steps_are_whole_and_accuracies_span_zero_to_one() -> None:
    import matplotlib.pyplot as plt

    history = [
        {"step": 0, "eval/accuracy": 0.0},
        *({"step": s, "reward/mean": -0.5 * s, "reward/accuracy": 0.0, "eval/math/accuracy": s / 8} for s in (1, 2, 3)),
    ]
    keys = ("reward/mean", "reward/accuracy", "eval/accuracy", "eval/math/accuracy")
    fig = curve_figure(history, keys)
    try:
        fig.canvas.draw()  # the tick locators run at draw time
        axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert list(axes) == list(keys)
        for ax in axes.values():  # eval/accuracy: step 0 alone
            lo, hi = ax.get_xlim()
            shown = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert shown and all(float(t).is_integer() for t in shown), (ax.get_title(), shown)
        for key in ("reward/accuracy", "eval/accuracy", "eval/math/accuracy"):
            assert axes[key].get_ylim() == (0.0, 1.0), key  # flat at 0 or rising: the same 0..1 axis
        lo, hi = axes["reward/mean"].get_ylim()  # not an accuracy: scaled to its values
        assert lo < -1.5 and -0.5 < hi < 0.0
    finally:
        plt.close(fig)


def test_an_accuracy_named_metric_outside_zero_to_one_keeps_its_own_scale() -> None:
    """Nothing is clipped off the panel: a value outside 0..1 under an accuracy name keeps autoscaling."""
    import matplotlib.pyplot as plt

    fig = curve_figure([{"step": 1, "x/accuracy": 0.5}, {"step": 2, "x/accuracy": 1.5}], ("x/accuracy",))
    try:
        lo, hi = fig.axes[0].get_ylim()
        assert lo <= 0.5 and hi >= 1.5
    finally:
        plt.close(fig)
