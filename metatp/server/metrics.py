"""`/metrics`: the scheduler's counters and gauges as Prometheus text."""

from __future__ import annotations

from metatp.metrics import Metrics, TenantCounters
from metatp.server.frontend import Frontend
from metatp.speculative import Speculator

ANONYMOUS_LABEL = "anonymous"          # the tenant of a server without API keys (and of the Python API)

# per tenant (label tenant="name"): metric name, TenantCounters attribute, help
_TENANT_COUNTERS = (
    ("tenant_requests_total", "requests", "Sequences accepted for the tenant (one per sample of n)."),
    ("tenant_prompt_tokens_total", "prompt_tokens", "Prompt tokens of the tenant's accepted sequences "
                                                   "(prefix-cache hits included, as usage counts them)."),
    ("tenant_generation_tokens_total", "generation_tokens", "Tokens generated for the tenant."),
    ("tenant_prefix_cache_queries_total", "prefix_queried_tokens",
     "The tenant's prompt tokens looked up in its own prefix-cache namespace."),
    ("tenant_prefix_cache_hits_total", "prefix_hit_tokens",
     "The tenant's prompt tokens found in its own prefix-cache namespace (never another tenant's)."),
)


def prometheus_text(srv: Frontend) -> str:
    """/metrics: llama-server's and vLLM's usual quantities in Prometheus text format."""
    s, m, cells = srv.sched, srv.sched.metrics, srv.llm.engine.cells
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.extend([f"# HELP metatp_{name} {help_}", f"# TYPE metatp_{name} {kind}", f"metatp_{name} {value}"])
    metric("requests_running", "gauge", "Sequences being decoded or prefilled.", s.n_running)
    metric("requests_waiting", "gauge", "Sequences waiting for a slot or KV cells.", s.n_waiting)
    metric("requests_total", "counter", "HTTP generation requests accepted.", srv.requests_total)
    metric("sequences_accepted_total", "counter", "Sequences queued (each ends finished, cancelled or failed).",
           m.requests_accepted)
    metric("sequences_finished_total", "counter", "Sequences that finished.", m.requests_finished)
    metric("sequences_cancelled_total", "counter", "Sequences cancelled (client gone).", m.requests_cancelled)
    metric("sequences_failed_total", "counter", "Sequences that failed.", m.requests_failed)
    metric("prompt_tokens_total", "counter", "Prompt tokens processed.", m.prompt_tokens)
    metric("generation_tokens_total", "counter", "Tokens generated.", m.generated_tokens)
    metric("steps_total", "counter", "Engine steps run.", m.steps)
    metric("preemptions_total", "counter", "Running sequences preempted for KV cells (recomputed later).",
           m.preemptions)
    metric("recomputed_tokens_total", "counter", "Tokens prefilled again after a preemption.", m.recomputed_tokens)
    metric("logits_bytes_total", "counter", "Logits bytes gathered from other processes for sampling "
           "(greedy rows move only their max and index).", srv.llm.engine.logits_bytes)
    metric("logits_candidate_rows_total", "counter", "Sampled rows read as each device's top candidates "
           "instead of the whole vocabulary.", srv.llm.engine.candidate_rows)
    metric("step_sequences_max", "gauge", "Most sequences one step carried.", m.max_step_seqs)
    metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           m.prefix_queried_tokens)
    metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not prefilled).",
           m.prefix_hit_tokens)
    metric("kv_cells_used", "gauge", "KV cells owned by sequences.", cells.n_used)
    metric("kv_cells_cached", "gauge", "KV cells the prefix cache holds (evicted when needed).", cells.n_cached)
    metric("kv_cells_total", "gauge", "KV cells in the cache (n_ctx).", cells.n_cells)
    lines += tenant_lines(m)
    lines += speculative_lines(s.speculator)
    hist = dict(m.step_seqs_hist)
    lines += ["# HELP metatp_step_sequences Sequences per engine step.", "# TYPE metatp_step_sequences histogram"]
    total = 0
    for b in (1, 2, 4, 8, 16, 32, 64):
        lines.append(f'metatp_step_sequences_bucket{{le="{b}"}} {sum(v for k, v in hist.items() if k <= b)}')
    total = sum(hist.values())
    lines += [f'metatp_step_sequences_bucket{{le="+Inf"}} {total}',
              f"metatp_step_sequences_sum {sum(k * v for k, v in hist.items())}", f"metatp_step_sequences_count {total}"]
    lines += ["# HELP metatp_time_to_first_token_seconds Time from submission to the first token.",
              "# TYPE metatp_time_to_first_token_seconds histogram"]
    for b in m.TTFT_BOUNDS:
        lines.append(f'metatp_time_to_first_token_seconds_bucket{{le="{b}"}} {m.ttft_buckets.get(b, 0)}')
    lines += [f'metatp_time_to_first_token_seconds_bucket{{le="+Inf"}} {m.ttft_count}',
              f"metatp_time_to_first_token_seconds_sum {m.ttft_sum}",
              f"metatp_time_to_first_token_seconds_count {m.ttft_count}"]
    return "\n".join(lines) + "\n"


def speculative_lines(speculator: Speculator | None) -> list[str]:
    """Speculative decoding's counts (`metatp.speculative.SpecStats`) under vLLM's
    spec_decode_* names: absent where the server does not speculate, as in vLLM."""
    if speculator is None:
        return []
    stats = speculator.stats
    rows = (("spec_decode_num_drafts_total", "counter", "Verification steps of speculating sequences.", stats.steps),
            ("spec_decode_num_draft_tokens_total", "counter", "Tokens drafted (n-gram lookup or the draft model).",
             stats.drafted),
            ("spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens the target model accepted.",
             stats.accepted),
            ("spec_decode_num_emitted_tokens_total", "counter",
             "Tokens given by verification steps (accepted drafts + the target's own token).", stats.emitted),
            ("spec_decode_draft_acceptance_rate", "gauge", "Accepted / drafted tokens so far (0 before any draft).",
             stats.acceptance))
    lines: list[str] = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP metatp_{name} {help_}", f"# TYPE metatp_{name} {kind}", f"metatp_{name} {value}"]
    return lines


def tenant_lines(m: Metrics) -> list[str]:
    """Each tenant's counters, labelled by its name (never its key): tenants that sent nothing
    yet are absent."""
    # a copy: the stepping thread adds tenants as they first send
    tenants: list[tuple[str | None, TenantCounters]] = list(dict(m.tenants).items())
    tenants.sort(key=lambda kv: (kv[0] is not None, kv[0] or ""))
    lines: list[str] = []
    for name, attr, help_ in _TENANT_COUNTERS:
        lines += [f"# HELP metatp_{name} {help_}", f"# TYPE metatp_{name} counter"]
        for tenant, counters in tenants:
            label = ANONYMOUS_LABEL if tenant is None else _label_value(tenant)
            lines.append(f'metatp_{name}{{tenant="{label}"}} {getattr(counters, attr)}')
    return lines


def _label_value(text: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
