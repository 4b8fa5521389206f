"""Encoder and classifier. The LightningModule lives in ``lra_cond.models.module`` (imported
separately: it depends on ``lra_cond.init``, which itself builds on the attention contract here)."""

from lra_cond.models.encoder import Classifier, Encoder, EncoderConfig, PairClassifier

__all__ = ["Classifier", "Encoder", "EncoderConfig", "PairClassifier"]
