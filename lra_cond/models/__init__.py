from lra_cond.models.encoder import Classifier, Encoder, EncoderConfig
from lra_cond.models.module import LraModel

__all__ = ["Classifier", "Encoder", "EncoderConfig", "LraModel"]
