"""What an all-reduce puts on the wire: FP32, or BF16 for large tensors (llama.cpp's cut-offs).

Small tensors (decode vectors) are latency-bound, so halving their bytes buys nothing and costs
exactness; large ones (prefill) are bandwidth-bound, so BF16 halves the time. The element counts
are llama.cpp's (ggml-cuda's NCCL path), tuned on RTX 4090s over PCIe 4 x16.
"""

from __future__ import annotations

from dataclasses import dataclass

from metatp.ir.errors import ConfigError

__all__ = ["WIRE_MODES", "WIRE_ITEMSIZE", "WireThresholds", "wire_dtype", "wire_itemsize"]

WIRE_MODES = ("auto", "f32", "bf16")
WIRE_ITEMSIZE = {"f32": 4, "bf16": 2}


@dataclass(frozen=True)
class WireThresholds:
    """Element counts below which an all-reduce travels as FP32 (above: BF16), per device
    count, as llama.cpp's cut-offs: n <= 2, n == 3, n >= 4."""

    n2: int = 32768
    n3: int = 131072
    n4: int = 262144

    def fp32_limit(self, n_devices: int) -> int:
        if n_devices <= 2:
            return self.n2
        return self.n3 if n_devices == 3 else self.n4


def wire_dtype(n_devices: int, n_elements: int, mode: str = "auto",
               thresholds: WireThresholds = WireThresholds()) -> str:
    """"f32" or "bf16": what one all-reduce of n_elements puts on the wire.

    mode "f32" keeps every reduction exact; "bf16" always halves the bytes; "auto" uses FP32
    for small tensors (latency-bound decode vectors) and BF16 for large ones (prefill)."""
    if mode not in WIRE_MODES:
        raise ConfigError(f"wire mode must be one of {', '.join(WIRE_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "f32" if n_elements < thresholds.fp32_limit(n_devices) else "bf16"


def wire_itemsize(n_devices: int, n_elements: int, mode: str = "auto",
                  thresholds: WireThresholds = WireThresholds()) -> int:
    """Bytes per element on the wire for one all-reduce (4 for FP32, 2 for BF16)."""
    return WIRE_ITEMSIZE[wire_dtype(n_devices, n_elements, mode, thresholds)]
