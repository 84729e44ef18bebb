"""What `qstate formats` lists: every format, rounding mode and preset, with bytes."""
from __future__ import annotations

from .config import PRESETS, ROUNDING_HELP, StateSpec, default_block, parse_config
from .formats import FORMATS


def format_rows(block_size: int | None = None) -> list[dict]:
    """One row per format: bits, bytes per element including scales at `block_size`
    (default: the format's own default; unscaled floats have no scales)."""
    rows = []
    for fmt in FORMATS.values():
        if fmt.kind == "identity":
            block = None
        elif fmt.blocked:
            block = block_size or default_block(fmt)
        else:
            block = block_size  # floats: scaled only when a block size is asked for
        spec = StateSpec(fmt, "nearest", block)
        rows.append({
            "format": fmt.name,
            "kind": fmt.kind,
            "bits": fmt.bits,
            "signed": fmt.signed,
            "block_size": spec.block if spec.scaled else None,
            "bytes_per_element": round(spec.bytes_per_element(), 6),
            "aliases": list(fmt.aliases),
            "purpose": fmt.purpose,
        })
    return rows


def rounding_rows() -> list[dict]:
    return [{"rounding": name, "purpose": text} for name, text in ROUNDING_HELP.items()]


def preset_rows() -> list[dict]:
    rows = []
    for name, (canon, text) in PRESETS.items():
        cfg = parse_config(canon)
        rows.append({
            "preset": name,
            "config": cfg.canonical(),
            "adamw_bytes_per_param": round(cfg.m.bytes_per_element() + cfg.v.bytes_per_element(), 6),
            "m_only_bytes_per_param": round(cfg.m.bytes_per_element(), 6),  # Lion, SGD, Muon keep m only
            "purpose": text,
        })
    return rows
