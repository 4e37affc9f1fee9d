"""Counters of a scheduler's work, for /metrics (Prometheus, `metatp.server.metrics`) and the benches."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["Metrics", "TenantCounters"]


@dataclass
class TenantCounters:
    """One tenant's share of the work (`Metrics.tenants`): what /metrics shows per tenant."""

    requests: int = 0                # sequences accepted (one per sample of n)
    prompt_tokens: int = 0           # ... their prompts' tokens, as usage counts them (cache hits included)
    generation_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0


@dataclass
class Metrics:
    """Counters for /metrics (Prometheus) and the batched bench."""

    requests_accepted: int = 0       # submitted and not refused; each ends finished, cancelled or failed
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    max_step_seqs: int = 0
    step_seqs_hist: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    ttft_buckets: dict[float, int] = field(default_factory=dict)
    preemptions: int = 0             # running requests whose cells were taken back (recomputed later)
    recomputed_tokens: int = 0       # tokens prefilled again after a preemption
    prefix_queried_tokens: int = 0   # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0       # ... found there (not prefilled)
    tenants: dict[str | None, TenantCounters] = field(default_factory=dict)   # by tenant name (None: anonymous)

    TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def tenant(self, name: str | None) -> TenantCounters:
        counters = self.tenants.get(name)
        if counters is None:
            counters = self.tenants[name] = TenantCounters()
        return counters

    def accept(self, tenant: str | None, n_prompt: int) -> None:
        """A sequence of `n_prompt` prompt tokens was accepted for `tenant`."""
        self.requests_accepted += 1
        counters = self.tenant(tenant)
        counters.requests += 1
        counters.prompt_tokens += n_prompt

    def generated(self, tenant: str | None) -> None:
        self.generated_tokens += 1
        self.tenant(tenant).generation_tokens += 1

    def count_prefix(self, tenant: str | None, queried: int, hit: int) -> None:
        """`queried` prompt tokens looked up in the prefix cache for `tenant`, `hit` of them found."""
        self.prefix_queried_tokens += queried
        self.prefix_hit_tokens += hit
        counters = self.tenant(tenant)
        counters.prefix_queried_tokens += queried
        counters.prefix_hit_tokens += hit

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for b in self.TTFT_BOUNDS:
            if seconds <= b:
                self.ttft_buckets[b] = self.ttft_buckets.get(b, 0) + 1
