"""Tenants (issue 48 item 3): several API keys, each a tenant; the prefix cache keyed by tenant
and by vLLM's cache_salt, so a prompt cached for one tenant (or salt) is never a hit for another.

What must hold: --api-key (repeated) and --api-key-file give the tenants, a bad key file is a
clear error at start that never quotes a key; a wrong key is a 401 naming nothing secret; a long
prompt from tenant A then tenant B prefills in full for B (no hit in the per-tenant counters, all
its tokens prefilled), while A's second send is a hit; the same tenant with different salts gets
no hit, with the same salt it does, through the server and the Python API alike; the keys never
appear in /metrics, errors or the log.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.ir.errors import ConfigError
from metatp.kv_cells import KVCells
from metatp.prefix_cache import ANONYMOUS, Namespace, PrefixCache
from metatp.request_fields import MAX_CACHE_SALT, FieldError
from metatp.server.tenants import AuthError, Tenants, bind_request_tenant, request_tenant
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe, optional_import

openai = optional_import("openai")
httpx = optional_import("httpx")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=11, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
LONG = [int(x) for x in np.random.default_rng(3).integers(3, 250, 300)]     # 300 tokens: 18 whole blocks of 16
HIT = (len(LONG) - 1) // 16 * 16       # what a repeat finds cached: every whole block but the last token's
ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-9876543210", "sk-carol-5555"


# ---------------------------------------------------------------- keys and tenants
def test_keys_from_flags_and_file(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# the team's keys\n\n  sk-one alice\nsk-two  alice\n sk-three bob \nsk-four\n")
    t = Tenants.from_keys(["sk-flag"], str(f))
    assert t.required and t.names == ["alice", "bob", "tenant-1", "tenant-5"]
    assert t.authenticate("Bearer sk-one") == t.authenticate("Bearer sk-two") == "alice"     # a rotated key
    assert t.authenticate("Bearer sk-three") == "bob" and t.authenticate("Bearer sk-flag") == "tenant-1"
    assert t.authenticate("bearer sk-four") == "tenant-5"
    for header in ("", "Bearer", "Bearer sk-on", "Basic sk-one", "sk-one", "Bearer alice"):
        with pytest.raises(AuthError) as e:
            t.authenticate(header)
        assert "sk-" not in str(e.value)
    assert "sk-" not in repr(t)                                  # digests only, and not even those shown
    anonymous = Tenants.from_keys()
    assert not anonymous.required and anonymous.authenticate("") is None and anonymous.authenticate("Bearer x") is None


@pytest.mark.parametrize("text, says", [
    ("", "no key in it"),
    ("# only a comment\n\n", "no key in it"),
    ("sk-1 alice extra\n", ":1: expected 'KEY' or 'KEY NAME', got 3 words"),
    ("sk-1 al/ice\n", ":1: a tenant name is"),
    ("sk-1 tenant-2\n", ":1: a tenant name is"),               # reserved for unnamed keys
    ("sk-1 alice\n\nsk-1 bob\n", ":3: this API key was already given"),
])
def test_a_bad_key_file_is_a_clear_error_that_never_quotes_a_key(tmp_path, text, says):
    f = tmp_path / "keys.txt"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)) as e:
        Tenants.from_keys([], str(f))
    assert "sk-1" not in str(e.value)


def test_key_flags_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"--api-key #2: this API key was already given \(--api-key #1\)"):
        Tenants.from_keys(["sk-a", "sk-a"])
    with pytest.raises(ConfigError, match="--api-key #1: an API key must be printable ASCII without spaces"):
        Tenants.from_keys(["sk a"])
    with pytest.raises(ConfigError, match="cannot read it"):
        Tenants.from_keys([], str(tmp_path / "missing.txt"))
    (tmp_path / "latin1.txt").write_bytes(b"sk-\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        Tenants.from_keys([], str(tmp_path / "latin1.txt"))


def test_serve_refuses_a_bad_key_file_before_reading_the_model(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("sk-secret alice bob\n")
    r = subprocess.run([sys.executable, "-m", "metatp", "serve", "-m", str(tmp_path / "no-model.gguf"),
                        "--api-key-file", str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"{f}:1: expected 'KEY' or 'KEY NAME'" in r.stderr
    assert "sk-secret" not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_the_request_tenant_is_the_handlers_own():
    """The auth check binds the tenant in the handler's context: another task's stays its own."""
    import asyncio

    async def handler(name):
        bind_request_tenant(name)
        await asyncio.sleep(0)
        return request_tenant(), await asyncio.to_thread(request_tenant)

    async def both():
        return await asyncio.gather(handler("alice"), handler("bob"), handler(None))
    assert asyncio.run(both()) == [("alice", "alice"), ("bob", "bob"), (None, None)]
    assert request_tenant() is None


# ---------------------------------------------------------------- the cache's namespaces
def test_a_chain_is_found_only_in_its_namespace():
    cells = KVCells(512, page=1)
    cache = PrefixCache(cells)
    ids = list(range(100, 164))
    alice, salted = Namespace("alice"), Namespace("alice", "s1")
    s = cells.try_reserve(64)
    s.n_past = 64
    assert cache.keep(s, ids, alice) == 4
    cells.free(s)
    assert len(cache.lookup(ids + [1], alice)) == 4
    for other in (ANONYMOUS, Namespace("bob"), salted, Namespace(None, "s1")):
        assert cache.lookup(ids + [1], other) == []
    t = cells.try_reserve(64)
    t.n_past = 64
    assert cache.keep(t, ids, Namespace("bob")) == 4              # bob's own copy: new blocks, new cells
    cells.free(t)
    assert cache.n_blocks == 8 and cells.n_cached == 128
    bobs, alices = (cache.lookup(ids + [1], ns)[0].cells for ns in (Namespace("bob"), alice))
    assert not np.isin(bobs, alices).any()


def test_cache_salt_is_checked_and_never_quoted():
    assert SamplingParams(cache_salt="x" * MAX_CACHE_SALT).cache_salt == "x" * MAX_CACHE_SALT
    assert "secret-salt" not in repr(SamplingParams(cache_salt="secret-salt"))
    for bad in ("", "y" * (MAX_CACHE_SALT + 1), 5, b"salt", ["s"]):
        with pytest.raises(FieldError) as e:
            SamplingParams(cache_salt=bad)
        assert e.value.field == "cache_salt" and "yyyy" not in str(e.value)


LLM_OPTIONS = {"n_ctx": 2048, "n_batch": 64}    # room for three cached copies of LONG and a fourth running


def test_python_api_honours_cache_salt(path):
    """LLM.generate with SamplingParams(cache_salt=...): hits only among requests of one salt."""
    llm = LLM(path, backend="numpy", enable_prefix_caching=True, **LLM_OPTIONS)
    m = llm.scheduler.metrics

    def hits(salt: str | None) -> int:
        before = m.prefix_hit_tokens
        llm.generate([LONG], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt))
        return m.prefix_hit_tokens - before
    assert hits("s1") == 0
    assert hits("s2") == 0 and hits(None) == 0           # another salt, and none: their own namespaces
    assert hits("s1") == HIT and hits("s2") == HIT and hits(None) == HIT
    assert llm.submit(LONG, SamplingParams(temperature=0.0, max_tokens=1, cache_salt="s1"), tenant="bob").result() is not None
    assert m.tenants["bob"].prefix_hit_tokens == 0 and m.tenants["bob"].requests == 1
    assert m.tenants[None].prefix_hit_tokens == 3 * HIT and m.tenants[None].requests == 6


def test_only_cells_reach_the_followers(path):
    """Under MPI the prefix cache (and its namespaces) lives on rank 0: the followers get cell
    operations alone, never a tenant or a salt, and mirror every cached cell all the same."""
    import pickle

    from metatp.kv_cells import CACHED
    from metatp.lockstep import STOP, follow
    from support.serving import LoopbackPosts, record_steps

    def make() -> LLM:
        return LLM(path, n_ctx=1024, backend="numpy", n_devices=2, split_mode="tensor", distributed="none",
                   max_num_seqs=2, n_batch=64, enable_prefix_caching=True)
    lead, rest = make(), make()
    posts: list = []
    lead.scheduler.lead(LoopbackPosts(0, posts))
    logs = record_steps(lead.engine, rest.engine)
    for tenant, salt in (("alice", None), ("bob", None), ("alice", "pepper-salt"), ("alice", None)):
        lead.submit(LONG[:100], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, cache_salt=salt),
                    tenant=tenant).result()
    assert lead.scheduler.metrics.tenants["alice"].prefix_hit_tokens == 96       # only alice's unsalted repeat
    assert lead.scheduler.metrics.tenants["bob"].prefix_hit_tokens == 0
    sent = pickle.dumps(posts)
    assert b"alice" not in sent and b"bob" not in sent and b"pepper-salt" not in sent
    assert follow(rest.engine, LoopbackPosts(1, posts + [STOP])) == len(logs[0])
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(*logs))
    assert any((own == CACHED).any() for own, _ in logs[1])


def test_per_tenant_metrics_lines():
    from metatp.metrics import Metrics
    from metatp.server.metrics import tenant_lines

    m = Metrics()
    assert [ln for ln in tenant_lines(m) if not ln.startswith("#")] == []     # nobody sent anything yet
    m.accept("bob", 10)
    m.accept(None, 3)
    m.generated("bob")
    m.count_prefix('we"ird\\', 32, 16)
    lines = tenant_lines(m)
    assert 'metatp_tenant_requests_total{tenant="anonymous"} 1' in lines
    assert 'metatp_tenant_requests_total{tenant="bob"} 1' in lines
    assert 'metatp_tenant_prompt_tokens_total{tenant="bob"} 10' in lines
    assert 'metatp_tenant_generation_tokens_total{tenant="bob"} 1' in lines
    assert 'metatp_tenant_prefix_cache_hits_total{tenant="we\\"ird\\\\"} 16' in lines
    assert m.requests_accepted == 2 and m.generated_tokens == 1 and m.prefix_hit_tokens == 16


@requires("serve")
def test_create_app_takes_several_keys_in_process(path):
    """create_app(api_key=[...]) through FastAPI's test client: each key's requests are its tenant's."""
    from metatp.server import create_app

    testclient = optional_import("fastapi.testclient")
    llm = LLM(path, backend="numpy", n_ctx=1024, enable_prefix_caching=True)
    with testclient.TestClient(create_app(llm, api_key=[ALICE, BOB], max_model_len=1024)) as client:
        def send(key: str) -> int:
            r = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1},
                            headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return llm.scheduler.metrics.prefix_hit_tokens
        assert send(ALICE) == 0 and send(BOB) == 0 and send(ALICE) == HIT and send(BOB) == 2 * HIT
        assert client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1}).status_code == 401
    assert set(llm.scheduler.metrics.tenants) == {"tenant-1", "tenant-2"}


# ---------------------------------------------------------------- metatp serve + openai
@pytest.fixture(scope="module")
def tenants_server(path, tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    keys = d / "keys.txt"
    keys.write_text(f"# two tenants\n{ALICE} alice\n{BOB} bob\n")
    s = MetatpServe(path, "-c", "4096", "--parallel", "2", "--max-model-len", "1024", "--api-key", CAROL,
                    "--api-key-file", str(keys), log=d / "server.log")
    yield s
    s.stop()


def _metrics(server) -> tuple[dict[str, float], dict[tuple[str, str], float], str]:
    text = httpx.get(server.base + "/metrics", headers={"Authorization": f"Bearer {CAROL}"}, timeout=30).text
    plain = {k: float(v) for k, v in re.findall(r"^(metatp_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}
    labelled = {(k, t): float(v) for k, t, v in re.findall(r'^(metatp_[a-z_]+)\{tenant="([^"]*)"\} ([0-9.e+-]+)$',
                                                            text, re.M)}
    return plain, labelled, text


def _send(server, key: str, salt: str | None = None) -> tuple[dict[str, float], float]:
    """LONG from `key`'s tenant (salted with `salt`): the counters' growth and the time to its first token."""
    before, _, _ = _metrics(server)
    t0 = time.perf_counter()
    extra = {"cache_salt": salt} if salt is not None else {}
    stream = server.client(key).completions.create(model="m", prompt=LONG, max_tokens=2, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True, **extra})
    ttft = None
    for _ in stream:
        ttft = ttft or time.perf_counter() - t0
    after, _, _ = _metrics(server)
    return {k: after[k] - before[k] for k in ("metatp_prefix_cache_hits_total", "metatp_prompt_tokens_total")}, ttft


@requires("serve")
def test_tenants_never_share_cached_prefixes(tenants_server):
    """A then A again (a hit), then B with the same prompt: no hit, every token prefilled."""
    first, ttft_first = _send(tenants_server, ALICE)
    again, ttft_again = _send(tenants_server, ALICE)
    other, ttft_other = _send(tenants_server, BOB)
    assert first == {"metatp_prefix_cache_hits_total": 0, "metatp_prompt_tokens_total": len(LONG)}
    assert again == {"metatp_prefix_cache_hits_total": HIT, "metatp_prompt_tokens_total": len(LONG) - HIT}
    assert other == {"metatp_prefix_cache_hits_total": 0, "metatp_prompt_tokens_total": len(LONG)}
    print(f"time to first token: alice {ttft_first * 1e3:.0f} ms, alice again {ttft_again * 1e3:.0f} ms, "
          f"bob {ttft_other * 1e3:.0f} ms")
    _, per, text = _metrics(tenants_server)
    assert per[("metatp_tenant_prefix_cache_hits_total", "alice")] == HIT
    assert per[("metatp_tenant_prefix_cache_hits_total", "bob")] == 0
    assert per[("metatp_tenant_requests_total", "alice")] >= 2 and per[("metatp_tenant_requests_total", "bob")] >= 1
    assert per[("metatp_tenant_generation_tokens_total", "bob")] >= 2
    assert per[("metatp_tenant_prompt_tokens_total", "bob")] >= len(LONG)
    for secret in (ALICE, BOB, CAROL):
        assert secret not in text and secret not in tenants_server.text()


@requires("serve")
def test_cache_salt_through_the_server(tenants_server):
    """One tenant (the unnamed --api-key's, tenant-1): another salt is no hit, the same salt is."""
    assert _send(tenants_server, CAROL, "salt-1")[0]["metatp_prefix_cache_hits_total"] == 0
    assert _send(tenants_server, CAROL, "salt-2")[0]["metatp_prefix_cache_hits_total"] == 0
    assert _send(tenants_server, CAROL, "salt-1")[0]["metatp_prefix_cache_hits_total"] == HIT
    assert _send(tenants_server, ALICE, "salt-1")[0]["metatp_prefix_cache_hits_total"] == 0    # a salt is per tenant
    _, per, _ = _metrics(tenants_server)
    assert per[("metatp_tenant_prefix_cache_hits_total", "tenant-1")] == HIT
    for bad in ("", "s" * (MAX_CACHE_SALT + 1), 7):
        r = httpx.post(tenants_server.base + "/v1/completions", headers={"Authorization": f"Bearer {CAROL}"},
                       json={"prompt": [5, 6, 7], "max_tokens": 1, "cache_salt": bad}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        assert "sss" not in r.text


@requires("serve")
def test_a_wrong_key_is_a_401_naming_nothing_secret(tenants_server):
    for headers in ({}, {"Authorization": "Bearer sk-alice-012345678"}, {"Authorization": f"Basic {ALICE}"}):
        r = httpx.post(tenants_server.base + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1},
                       headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert not any(s in r.text for s in (ALICE, BOB, CAROL, "sk-alice", "alice", "bob"))
        assert httpx.get(tenants_server.base + "/metrics", headers=headers, timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        tenants_server.client("sk-nobody").completions.create(model="m", prompt=[5, 6], max_tokens=1)
    for key in (ALICE, BOB, CAROL):
        assert tenants_server.client(key).completions.create(model="m", prompt=[5, 6], max_tokens=1).choices
