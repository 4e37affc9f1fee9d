"""The split compiler: split table, propagation rules, partition, coalescing, lowering."""

from metatp.passes.compile import STAGES, compile_plan, compile_stages
from metatp.passes.plan import DeviceLayout, Plan
from metatp.passes.state import MIRRORED, PARTIAL, SplitState

__all__ = ["compile_plan", "compile_stages", "STAGES", "SplitState", "DeviceLayout", "Plan", "MIRRORED", "PARTIAL"]
