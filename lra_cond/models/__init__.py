"""Encoder and classifier (``encoder``) and the attention families (``attention/``). The
LightningModule that trains them is ``lra_cond.training.module``."""

from lra_cond.models.encoder import Classifier, Encoder, EncoderConfig, PairClassifier

__all__ = ["Classifier", "Encoder", "EncoderConfig", "PairClassifier"]
