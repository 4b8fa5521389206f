"""lra_cond: Long Range Arena suite for studying attention-weight initialization."""

__version__ = "0.1.0"
