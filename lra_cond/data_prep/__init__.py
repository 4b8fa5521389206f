"""``lra_cond.data_prep`` in a source checkout: the modules of the top-level ``data_prep/`` folder.

A wheel (``pip install .``) ships that folder itself as ``lra_cond/data_prep/`` (``package-dir`` in
pyproject.toml), so an install has no top-level ``data_prep`` package to shadow or be shadowed; in a
checkout (``PYTHONPATH=.`` or ``pip install -e .``) this file points the package at the folder. Either
way the code imports ``lra_cond.data_prep.<module>``.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "data_prep")]
