"""Plan facts for backends: `PlanFacts` and `is_pure_view` live in `metatp.passes.facts` (they
are analysis of a Plan, and passes must not import backends); this name stays for backend code
written against it."""

from metatp.passes.facts import PlanFacts, is_pure_view

__all__ = ["PlanFacts", "is_pure_view"]
