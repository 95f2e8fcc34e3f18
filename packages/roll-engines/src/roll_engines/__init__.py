"""roll-engines: training engines (hf, fsdp2) and inference engines (hf) for roll; GPU engines register here."""

__version__ = "0.1.0"
