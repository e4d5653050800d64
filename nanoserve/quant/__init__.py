"""Quantized checkpoints: their configs (config.py), their tensors and dequantization
(formats.py), and the linear layer that holds them (linear.py)."""

from nanoserve.quant.config import QuantConfig, UnsupportedQuantization
from nanoserve.quant.linear import QuantizedLinear

__all__ = ["QuantConfig", "QuantizedLinear", "UnsupportedQuantization"]
