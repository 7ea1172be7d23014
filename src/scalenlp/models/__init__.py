"""Pure PyTorch model definitions: nothing in this package imports torch.distributed."""

from scalenlp.models.decoder import KVCache, ModelArgs, Transformer
from scalenlp.models.flavors import FLAVORS, build_model, model_args

__all__ = ["FLAVORS", "KVCache", "ModelArgs", "Transformer", "build_model", "model_args"]
