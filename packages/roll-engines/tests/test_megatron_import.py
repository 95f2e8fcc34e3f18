"""Importing Megatron-Core in an engine process leaves no wandb temporary folders (megatron._import)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wandb", reason="the case needs wandb installed (roll-core[wandb])")

_CHILD = textwrap.dedent(
    """
    import glob, sys, tempfile
    before = set(glob.glob(tempfile.gettempdir() + "/tmp*wandb-*"))
    from roll_engines.train.megatron._import import import_megatron
    import_megatron()
    import megatron.core.inference.contexts.dynamic_context as dc
    from megatron.core.models.gpt import GPTModel  # what the engine imports after it
    print("wandb imported:", "wandb" in sys.modules, "megatron's wandb:", getattr(dc, "wandb", "absent"))
    print("new folders:", sorted(set(glob.glob(tempfile.gettempdir() + "/tmp*wandb-*")) - before))
    import wandb  # roll's W&B tracker may still import it
    print("later import:", wandb.__name__)
    """
)


def test_importing_megatron_imports_no_wandb_and_leaves_no_temporary_folders(tmp_path) -> None:
    """megatron.core's inference context imports wandb, whose import makes two /tmp folders a killed Ray worker
    never removes: every Megatron rank of every run left a pair. The engine imports megatron with wandb hidden; a
    later `import wandb` still works."""
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "wandb imported: False megatron's wandb: None" in out.stdout, out.stdout
    assert "new folders: []" in out.stdout, out.stdout
    assert "later import: wandb" in out.stdout
