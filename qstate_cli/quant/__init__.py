"""The math layer: formats, rounding, the hash, quantized states. Pure torch, no I/O."""
from .config import PRESETS, ROUNDINGS, StateConfig, StateSpec, parse_config, parse_spec
from .formats import FORMATS, Format, bytes_per_element, get_format, state_bytes
from .quantizer import Stream, decode, encode, sqrt_rn
from .state import QuantizedState

__all__ = [
    "FORMATS", "Format", "PRESETS", "ROUNDINGS", "QuantizedState", "StateConfig", "StateSpec",
    "Stream", "bytes_per_element", "decode", "encode", "get_format", "parse_config", "parse_spec",
    "sqrt_rn", "state_bytes",
]
