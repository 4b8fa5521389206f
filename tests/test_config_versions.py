"""A run saved before an option existed: its config.yaml lacks the key, and the run behaved as the
option's default. Resume and compare count the missing key as that default, so a suite upgrade
does not strand unfinished runs, while a command that sets the new option otherwise is still
refused."""

from __future__ import annotations

from lra_cond.run_dir import RESUME_MAY_CHANGE, config_differences
from lra_cond.training.compare import resolved_config

FIT = ["fit", "--task", "listops", "--data.preset", "tiny", "--trainer.max_steps", "20"]
NEW_OPTIONS = (("data", "drop_tokens"), ("model", "pool_length"))


def older(config: dict) -> dict:
    """``config`` as a suite without the newer options saved it."""
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for group, key in NEW_OPTIONS:
        del old[group][key]
    return old


def test_a_missing_key_counts_as_the_options_default():
    mine, defaults = resolved_config(FIT, with_defaults=True)
    assert all(defaults[group][key] is None for group, key in NEW_OPTIONS)
    theirs = older(mine)
    assert config_differences(theirs, mine, RESUME_MAY_CHANGE) == ["data.drop_tokens", "model.pool_length"]
    assert config_differences(theirs, mine, RESUME_MAY_CHANGE, defaults) == []
    assert config_differences(mine, theirs, RESUME_MAY_CHANGE, defaults) == []


def test_a_new_option_set_otherwise_is_still_a_difference():
    mine, defaults = resolved_config([*FIT, "--model.pool_length", "2048"], with_defaults=True)
    theirs = older(resolved_config(FIT))
    assert config_differences(theirs, mine, RESUME_MAY_CHANGE, defaults) == ["model.pool_length"]
    # A key neither the defaults nor the other config know stays a difference.
    theirs["model"]["made_up"] = 1
    assert config_differences(theirs, mine, RESUME_MAY_CHANGE, defaults) == [
        "model.made_up",
        "model.pool_length",
    ]
