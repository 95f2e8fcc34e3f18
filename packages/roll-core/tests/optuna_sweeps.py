"""hydra-optuna-sweeper (Optuna 2.10) for roll-core's Optuna sweep tests (test_sweep_optuna_*.py, which put this
folder on sys.path to import it). Importing it skips the importing test module where roll-core[sweep] is not
installed, and imports Optuna and the sweeper's config with the DeprecationWarning Optuna 2.10 raises at import
(declarative_base from SQLAlchemy's 1.x place) silenced: the test session turns warnings into errors.

- `optuna`, `Direction`: the modules' objects, imported as said.
- `OPTUNA_SWEEPER`: the sweeper's `_target_`.
- `SQLALCHEMY_1_WARNINGS`: pytest marks (a module's `pytestmark`) ignoring the SQLAlchemy 1.x APIs Optuna 2.10 uses
  that SQLAlchemy 2 deprecates (declarative_base in its alembic revisions, Query.with_labels).
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install roll-core[sweep]")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import optuna
    from hydra_plugins.hydra_optuna_sweeper.config import Direction

__all__ = ["OPTUNA_SWEEPER", "SQLALCHEMY_1_WARNINGS", "Direction", "optuna"]

OPTUNA_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
SQLALCHEMY_1_WARNINGS = [
    pytest.mark.filterwarnings("ignore:.*declarative_base:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*with_labels:DeprecationWarning"),
]
