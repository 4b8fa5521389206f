"""Training: the LightningModule (``module``), the LightningCLI subclass behind ``fit``/``validate``/
``test`` (``lightning_cli``), fit's argument conventions (``arguments``: ``--task`` configs and the
shortcuts), the sweep orchestrator (``compare``) and the step timer (``bench``).

This package sits above ``models``, ``init``, ``data`` and ``callbacks``; ``lra_cond.cli`` sits above it.
"""
