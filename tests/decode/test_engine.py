"""Native serving engine: greedy tokens equal HyLoForCausalLM.generate (MLA+GDN, MLA+Mamba-2, q/k norms, batch 1
and 2, chunked prefill), absorbed MLA decode equals the unabsorbed module in float64, baseline engine equals
transformers' generate, caches are preallocated with the documented sizes."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.decode.engine import Engine, TransformerEngine, make_engine
from hylo_bench.decode.mla_layer import MLAServing
from hylo_bench.models.hybrid import HyLoForCausalLM
from tests.conftest import make_base, tiny_hybrid_config

LAYOUTS = {
    "gdn": {},
    "mamba": {"linear_type": "mamba"},
    "gdn-qknorm": {"use_qk_norm": True},
}


def _model(kind: str, dtype=torch.float32, seed: int = 0) -> HyLoForCausalLM:
    torch.manual_seed(seed)
    m = HyLoForCausalLM(tiny_hybrid_config(**LAYOUTS[kind])).eval().to(dtype)
    with torch.no_grad():  # larger weights: sharper logits, so greedy ties cannot hide a mismatch
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3)
    return m


def _hf_greedy(model, ids, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("batch,chunk", [(1, 64), (2, 64), (2, 5), (1, 7)])
def test_engine_greedy_equals_model_generate(kind, batch, chunk):
    model = _model(kind)
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (batch, 13))
    want = _hf_greedy(model, ids, 8)
    engine = Engine(model, max_batch=2, max_context=32, prefill_chunk=chunk)
    got, timings = engine.generate(ids, max_new_tokens=8)
    assert torch.equal(got, want), (got, want)
    assert timings.new_tokens == 8 and len(timings.decode_step_s) == 7 and timings.prompt_tokens == 13
    again, _ = engine.generate(ids, max_new_tokens=8)  # reset between calls: same answer from a used engine
    assert torch.equal(again, want)


@pytest.mark.parametrize("kind", ["gdn", "gdn-qknorm"])
def test_prefill_logits_match_full_forward_in_float64(kind, rms_float64):
    model = _model(kind, torch.float64)
    ids = torch.randint(3, 97, (2, 11))
    want = model(ids).logits[:, -1]
    got = Engine(model, max_batch=2, max_context=16, prefill_chunk=4).prefill(ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-10 * want.abs().max().item())


def _mla_layer_and_forward(qk_norm: bool, seed: int):
    """A float64 tiny hybrid's MLA layer (random q/k norm weights when ``qk_norm``), an input x [2, 10, 64] and the
    module's full causal forward of it [2, 10, 64]."""
    torch.manual_seed(seed)
    model = HyLoForCausalLM(tiny_hybrid_config(use_qk_norm=qk_norm)).double().eval()
    mla = model.model.layers[1].mla
    with torch.no_grad():
        if qk_norm:
            mla.q_norm.weight.uniform_(0.5, 1.5)
            mla.k_norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(2, 10, 64, dtype=torch.float64)
        want, _ = mla(x, torch.arange(10).expand(2, 10))
    return mla, x, want


@pytest.mark.parametrize("qk_norm", [False, True])
def test_absorbed_mla_decode_equals_unabsorbed_in_float64(qk_norm, rms_float64):
    """One MLA layer: prefill 9 tokens, decode the 10th. Absorbed form (engine) vs the module's forward, which
    decompresses K/V per head (checkpoint-format.md §5.1 vs §6)."""
    mla, x, want = _mla_layer_and_forward(qk_norm, seed=3)  # the last row of want is the 10th token's output
    with torch.no_grad():
        srv = MLAServing(mla, decode_backend="torch")
        slot = srv.new_slot(2, 16)
        srv.prefill(x[:, :9], slot, 0)
        got = srv.decode(x[:, 9:], slot, torch.tensor([9, 9]))
    ref = want[:, 9:]
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-10, rel
    assert torch.equal(slot.latent[:, 10:], torch.zeros_like(slot.latent[:, 10:]))  # nothing past the token


@pytest.mark.parametrize("qk_norm", [False, True])
def test_chunked_mla_prefill_equals_the_module_forward_in_float64(qk_norm, rms_float64):
    """One MLA layer prefilled in chunks of 4, 3 and 3 tokens: every chunk's output equals the module's full causal
    forward. Random q/k norm weights, so the key norm folded into the prefill's decompression weight is exercised
    (the engine tests' norms are ones)."""
    mla, x, want = _mla_layer_and_forward(qk_norm, seed=4)
    with torch.no_grad():
        srv = MLAServing(mla, decode_backend="torch")
        slot = srv.new_slot(2, 16)
        got = torch.cat([srv.prefill(x[:, a:b], slot, a) for a, b in ((0, 4), (4, 7), (7, 10))], dim=1)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-10, rel


def test_engine_preallocates_caches_of_the_documented_size():
    model = _model("gdn-qknorm")
    cfg = model.config
    e = Engine(model, max_batch=3, max_context=40, prefill_chunk=8)
    sizes = e.cache_bytes()
    n_mla = len(cfg.mla_layers)
    assert sizes["mla_latent"] == n_mla * 3 * 40 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert sizes["mla_key_scale"] == n_mla * 3 * 40 * cfg.num_key_value_heads * 4
    gdn = model.model.layers[0].gdn
    assert sizes["linear_state"] == (cfg.n_layer - n_mla) * 3 * gdn.state_bytes_per_sequence()


def test_engine_rejects_requests_beyond_capacity():
    e = Engine(_model("gdn"), max_batch=1, max_context=10, prefill_chunk=4)
    with pytest.raises(ValueError, match="max_batch"):
        e.generate(torch.ones(2, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_context"):
        e.generate(torch.ones(1, 8, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="TransformerEngine"):
        Engine(make_base("llama"), 1, 8)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_transformer_engine_equals_transformers_generate(kind):
    model = make_base(kind, vocab_size=120)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    ids = torch.randint(3, 120, (2, 12))
    want = _hf_greedy(model, ids, 6)
    engine = make_engine(model, max_batch=2, max_context=20, prefill_chunk=5)
    assert isinstance(engine, TransformerEngine)
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want), (got, want)
    assert engine.cache_bytes()["kv"] == 4 * 2 * 2 * 2 * 20 * 16 * 4  # layers * (K, V) * B * n_kv * Tm * d_h * fp32


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_transformer_engine_prefill_logits_match_full_forward_in_float64(kind):
    """The baseline runs the model's own layers over its cache: chunked prefill (chunks of 4 over 11 tokens, so
    lower-right causal masks over the cached prefix) gives the full forward's last logits to float64 rounding, and
    the model itself, switched to the engine's attention function, still gives its own logits, padding mask
    included (a left-padded batch, as generate() and lm-eval run it)."""
    model = make_base(kind, vocab_size=120).to(torch.float64)
    ids = torch.randint(3, 120, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        before = model(ids).logits[:, -1]
        before_padded = model(ids, attention_mask=mask).logits
    engine = TransformerEngine(model, max_batch=2, max_context=16, prefill_chunk=4)
    got = engine.prefill(ids)
    with torch.no_grad():
        after = model(ids).logits[:, -1]
        after_padded = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, before, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    assert (before_padded[0, -1] - before[0]).abs().max() > 1e-3  # the mask matters
    torch.testing.assert_close(after_padded[:, 4:], before_padded[:, 4:], rtol=1e-12, atol=1e-12)


def test_decode_benchmark_then_generate_still_matches():
    """The synthetic-context decode fills the caches with noise; the next generate must not see any of it."""
    model = _model("gdn")
    ids = torch.randint(3, 97, (1, 9))
    want = _hf_greedy(model, ids, 5)
    engine = Engine(model, max_batch=1, max_context=40, prefill_chunk=4)
    t = engine.decode_benchmark(1, 30, 6)
    assert (t.prompt_tokens, len(t.decode_step_s)) == (30, 6)
    assert engine.slots[1].latent[0, :30].abs().sum() > 0
    assert engine.time_prefill_chunk(1, 26, 4) > 0
    got, _ = engine.generate(ids, 5)
    assert torch.equal(got, want)


def test_random_build_materialises_every_parameter():
    from hylo_bench.serving.build import _materialise

    cfg = tiny_hybrid_config(linear_type="mamba", use_qk_norm=True)
    with torch.device("meta"):
        model = HyLoForCausalLM(cfg)
    _materialise(model, "cpu", torch.bfloat16, ("A_log", "dt_bias"))
    for name, p in model.named_parameters():
        assert torch.isfinite(p.float()).all(), name
        assert p.dtype == (torch.float32 if name.endswith(("A_log", "dt_bias")) else torch.bfloat16), name
    mamba = model.model.layers[0].mamba
    assert torch.all(mamba.A_log > 0) and torch.all(mamba.D == 1) and torch.all(mamba.norm.weight == 1)
    assert model.model.layers[1].mla.q_norm.weight.eq(1).all()
    assert 0.015 < model.lm_head.weight.float().std().item() < 0.025


def test_compiled_decode_step_traces_whole_and_gives_the_same_tokens():
    """``compile=True`` traces the decode step as one graph (fullgraph: the MLA and GDN kernels are opaque
    custom ops, hylo_bench/kernels/*/ops.py) and decodes the same greedy tokens as generate(). aot_eager keeps the
    CPU test fast; Inductor runs in the GPU test below."""
    model = _model("gdn-qknorm")
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (2, 13))
    want = _hf_greedy(model, ids, 6)
    engine = Engine(model, max_batch=2, max_context=32, prefill_chunk=64, compile=True, compile_backend="aot_eager")
    got, _ = engine.generate(ids, 6)
    assert engine.compiled and torch.equal(got, want), (got, want)
    # the fused-GEMV step traces whole too (hylo::fused_gemv is an opaque op; on CPU it runs the torch reference)
    engine = Engine(model, max_batch=2, max_context=32, prefill_chunk=64, compile=True, compile_backend="aot_eager",
                    gemv_backend="triton")
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want), (got, want)


@pytest.fixture
def gc_off():
    import gc

    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("compile", [False, True])
def test_a_dropped_engine_is_freed_at_once(compile, gc_off):
    """With the garbage collector off, dropping the last reference frees the engine (and so its caches): no
    reference cycle through the stored, possibly compiled, decode step. Continuous batching and the engine's
    growth in NativeDecoder (old engine dropped before the larger one is built) rely on it."""
    import types
    import weakref

    from hylo_bench.decode.batching import Request, continuous_generate
    from hylo_bench.decode.greedy import NativeDecoder

    model = _model("gdn")
    kw = {"compile": True, "compile_backend": "aot_eager"} if compile else {}
    engine = Engine(model, max_batch=2, max_context=32, prefill_chunk=4, **kw)
    out = continuous_generate(engine, [Request(ids=[5, 6, 7, 8, 9], max_new_tokens=3),
                                       Request(ids=[5, 6, 7, 8, 10, 11], max_new_tokens=2)], set())
    assert [len(t) for t in out] == [3, 2]
    ref = weakref.ref(engine)
    del engine
    assert ref() is None
    decoder = NativeDecoder(model, tokenizer=types.SimpleNamespace(eos_token_id=2), batch_size=2)
    first = weakref.ref(decoder._ensure(8))
    decoder._ensure(decoder.capacity + 1)  # a longer prompt: a larger engine replaces the first
    assert first() is None and decoder.engine is not None


def test_gdn_decode_custom_op_updates_the_state_like_the_step():
    """hylo::gdn_decode_step mutates the state in place to the torch step's new state (float64)."""
    from hylo_bench.kernels.gated_delta import gated_delta_rule_step

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 1, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 1, 3, 5, generator=g, dtype=torch.float64)
    gate = -torch.rand(2, 1, 3, generator=g, dtype=torch.float64)
    beta = torch.rand(2, 1, 3, generator=g, dtype=torch.float64)
    state = torch.randn(2, 3, 8, 5, generator=g, dtype=torch.float64)
    want_o, want_state = gated_delta_rule_step(q, k, v, gate, beta, state.clone(), use_qk_l2norm_in_kernel=True)
    o = torch.ops.hylo.gdn_decode_step(q, k, v, gate, beta, state, "torch")
    assert torch.equal(o, want_o) and torch.equal(state, want_state)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn-qknorm", "mamba"])
def test_gpu_engine_graphs_and_kernels_match_the_torch_paths(kind):
    """bf16 on CUDA: CUDA-graph decode gives the eager tokens; the Triton / fla decode back ends give the torch
    back ends' logits (relative L2 < 2e-2 after prefill + 6 decode steps)."""
    model = _model(kind).cuda().to(torch.bfloat16)
    for layer in model.model.layers:  # keep the gate parameters fp32, as loading does
        for name in ("A_log", "dt_bias"):
            if hasattr(layer.mixer, name):
                getattr(layer.mixer, name).data = getattr(layer.mixer, name).data.float()
    ids = torch.randint(3, 97, (2, 300), device="cuda")
    fast = Engine(model, 2, 320, 128, cuda_graphs=True)
    eager = Engine(model, 2, 320, 128)
    tok_fast, t = fast.generate(ids, 8)
    tok_eager, _ = eager.generate(ids, 8)
    assert t.cuda_graphs and fast.graph_error is None
    assert torch.equal(tok_fast, tok_eager)
    compiled = Engine(model, 2, 320, 128, cuda_graphs=True, compile=True, compile_mode="default")
    tok_compiled, tc = compiled.generate(ids, 8)  # Inductor + graph capture of the compiled step
    assert tc.cuda_graphs and compiled.graph_error is None
    assert (tok_compiled == tok_eager).float().mean() >= 0.75, (tok_compiled, tok_eager)  # bf16 fusions reorder
    ref = Engine(model, 2, 320, 128, mla_decode_backend="torch", gdn_decode_backend="torch")
    for e in (eager, ref):
        e.prefill(ids)
        pos = torch.full((2,), 300, device="cuda")
        tok = tok_eager[:, 0].cuda()
        for _ in range(6):
            h = e.model.model.embed_tokens(tok[:, None])
            for i in range(len(e.layers)):
                h = e._layer(i, h, None, pos)
            logits = e._lm_logits(h)[:, -1].float()
            pos = pos + 1
        e.last_logits = logits
    rel = ((eager.last_logits - ref.last_logits).norm() / ref.last_logits.norm()).item()
    assert rel < 2e-2, rel


@pytest.mark.gpu
def test_gpu_dropped_engine_returns_its_memory(gc_off):
    """A compiled CUDA-graph engine is freed when dropped, with the garbage collector off, and its caches' bytes
    come back. (Not every byte: torch keeps a cuBLAS workspace per stream that ran a GEMM, the capture's included.)"""
    import weakref

    model = _model("gdn").cuda().to(torch.bfloat16)
    engine = Engine(model, 2, 65536, 128, cuda_graphs=True, compile=True, compile_mode="default")
    tok, t = engine.generate(torch.randint(3, 97, (2, 300), device="cuda"), 4)
    assert t.cuda_graphs and engine.graph_error is None
    cache = sum(engine.cache_bytes().values())
    assert cache > 20 * 2**20
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    ref = weakref.ref(engine)
    del engine, tok, t
    torch.cuda.synchronize()
    assert ref() is None
    assert torch.cuda.memory_allocated() <= held - cache


@pytest.mark.parametrize("kind,q_lora_rank", [("gdn", 48), ("gdn-qknorm", None), ("mamba", 48)])
def test_merged_projections_keep_weights_and_logits(kind, q_lora_rank, rms_float64, tmp_path):
    """Merging the decode projections (GDN q/k/v/a/b/g, MLA q + kv_a, MLP gate + up) rebinds the weights as views of
    one buffer per layer: state dict unchanged, save/load still bit-exact, and prefill and every decode step give
    the unmerged engine's logits (float64)."""
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(q_lora_rank=q_lora_rank, **LAYOUTS[kind])).eval().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, 97, (2, 11))

    def run(engine):
        logits = []
        engine._logits_to_token = lambda h: logits.append(engine._lm_logits(h)[:, -1]) or logits[-1].argmax(-1)
        tokens, _ = engine.generate(ids, max_new_tokens=5)
        return tokens, torch.stack(logits)

    tok_want, want = run(Engine(model, max_batch=2, max_context=16, prefill_chunk=4, merge_projections=False))
    engine = Engine(model, max_batch=2, max_context=16, prefill_chunk=4)
    layers = model.model.layers
    mla = layers[1].mixer
    first = mla.q_proj if q_lora_rank is None else mla.q_a_proj
    assert first.weight.data_ptr() == engine.mixers[1].merged.weight.data_ptr()
    assert mla.kv_a_proj_with_mqa.weight.data_ptr() == first.weight.data_ptr() + first.weight.numel() * 8
    assert engine.merged_mlps[0].splits == (128, 128)
    if kind.startswith("gdn"):
        g = layers[0].mixer
        assert engine.mixers[0].merged.splits == (32, 32, 64, 2, 2, 64)
        assert g.g_proj.weight.data_ptr() == g.q_proj.weight.data_ptr() + (32 + 32 + 64 + 2 + 2) * 64 * 8
    else:
        assert engine.mixers[0].merged is None
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    tok_got, got = run(engine)
    assert torch.equal(tok_got, tok_want)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * want.abs().max().item())
    model.save_pretrained(tmp_path)
    loaded = HyLoForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert all(torch.equal(v, before[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("kind", ["gdn", "gdn-qknorm", "mamba"])
def test_fused_gemv_engine_equals_torch_engine(kind):
    """gemv_backend="triton" routes every decode GEMV through hylo_bench.kernels.gemv with the layer norms, SwiGLU,
    residual adds and final norm folded in; on CPU it runs the kernel's torch reference, so this checks the
    plumbing: prefill and every decode step give the unfused engine's logits (float64), and a Mamba-2 mixer keeps
    its own path (only its MLP is fused). The reference mirrors LlamaRMSNorm (float32 statistics), so no
    rms_float64 here."""
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(**LAYOUTS[kind])).eval().double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)  # norm weights away from 1, so a missing norm shows
    ids = torch.randint(3, 97, (2, 11))

    def run(engine):
        logits = []
        lm = engine._lm_logits
        engine._lm_logits = lambda h: logits.append(lm(h)[:, -1]) or logits[-1][:, None]
        tokens, _ = engine.generate(ids, max_new_tokens=5)
        return tokens, torch.stack(logits)

    tok_want, want = run(Engine(model, max_batch=2, max_context=16, prefill_chunk=4))
    from hylo_bench.decode.engine import FUSED_GEMVS

    engine = Engine(model, max_batch=2, max_context=16, prefill_chunk=4, gemv_backend="triton",
                    fused_gemvs=FUSED_GEMVS)
    assert engine.fused == [(kind != "mamba", True), (True, True), (kind != "mamba", True), (True, True)]
    assert engine.fused_head
    calls = []
    from hylo_bench.kernels.gemv import ops

    orig = ops._impl_gemv
    gated = []
    ops._impl_gemv = lambda *a: calls.append(a[2] is not None) or gated.append(a[6] is not None) or orig(*a)
    try:
        tok_got, got = run(engine)
    finally:
        ops._impl_gemv = orig
    assert torch.equal(tok_got, tok_want)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * want.abs().max().item())
    # per decode step (4 steps after the prefill's token): 2 mixers' merged GEMV + out GEMV (fewer for Mamba-2),
    # 4 MLPs x 2, and the lm_head for prefill + 4 steps
    mixers = 4 if kind != "mamba" else 2
    gdn = 2 if kind != "mamba" else 0  # GDN o_proj: the gated output norm in its prologue
    assert len(calls) == 4 * (2 * mixers + 8) + 5
    # with a norm prologue: first projections, GDN o_proj (gated), gate_up, lm_head
    assert sum(calls) == 4 * (mixers + gdn + 4) + 5
    assert sum(gated) == 4 * gdn


def _float64_model_with_norms_off_one():
    """The tiny hybrid in float64 with its norm weights moved away from 1 (so a missing norm shows), seeded."""
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config()).eval().double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _decode_logits(engine, ids, new_tokens):
    """The last-position logits of every step of ``engine.generate`` (prefill, then each decode token), stacked."""
    outs = []
    lm = engine._lm_logits
    engine._lm_logits = lambda h: outs.append(lm(h)[:, -1]) or outs[-1][:, None]
    engine.generate(ids, max_new_tokens=new_tokens)
    return torch.stack(outs)


@pytest.mark.parametrize("subset", [("in", "out"), ("gate_up", "head"), ("out", "down")])
def test_fused_gemv_subsets_equal_torch_engine(subset):
    """Any subset of fused GEMVs (the rest on F.linear with separate norms / adds) keeps the logits (float64)."""
    model = _float64_model_with_norms_off_one()
    ids = torch.randint(3, 97, (2, 11))
    logits = {}
    for name, kw in (("torch", {}), ("fused", {"gemv_backend": "triton", "fused_gemvs": subset})):
        engine = Engine(model, max_batch=2, max_context=16, prefill_chunk=4, **kw)
        logits[name] = _decode_logits(engine, ids, 5)
    assert engine.fused_head == ("head" in subset)
    want = logits["torch"]
    assert torch.allclose(logits["fused"], want, rtol=0, atol=1e-12 * want.abs().max().item())


def test_mlp_chain_at_batch_one_equals_the_two_gemv_path():
    """fused_gemvs "mlp_chain": batch-1 decode tokens run each layer's MLP through ``hylo::mlp_chain`` (its reference
    on CPU, float64), one call per layer and token, and keep the logits of the two-GEMV path exactly."""
    from hylo_bench.decode.engine import DEFAULT_FUSED_GEMVS
    from hylo_bench.kernels.gemv import ops

    model = _float64_model_with_norms_off_one()
    ids = torch.randint(3, 97, (1, 9))
    logits, calls = {}, []
    orig = ops._impl_chain
    ops._impl_chain = lambda *a: calls.append(a[0].shape) or orig(*a)
    try:
        for name, extra in (("two", ()), ("chain", ("mlp_chain",))):
            engine = Engine(model, max_batch=1, max_context=16, prefill_chunk=4, gemv_backend="triton",
                            fused_gemvs=DEFAULT_FUSED_GEMVS + extra)
            logits[name] = _decode_logits(engine, ids, 4)
    finally:
        ops._impl_chain = orig
    assert len(calls) == 3 * len(model.model.layers)  # 3 decode tokens after the prefill's first
    assert all(tuple(c) == (1, 1, model.config.hidden_size) for c in calls)
    assert torch.equal(logits["chain"], logits["two"])


def test_fused_gemv_engine_refuses_unmerged():
    model = HyLoForCausalLM(tiny_hybrid_config()).eval()
    with pytest.raises(ValueError, match="merge_projections=True"):
        Engine(model, 1, 8, gemv_backend="triton", merge_projections=False)
    with pytest.raises(ValueError, match="gemv_backend='cuda'"):
        Engine(model, 1, 8, gemv_backend="cuda")
    with pytest.raises(ValueError, match=r"fused_gemvs \['qkv'\] unknown"):
        Engine(model, 1, 8, gemv_backend="triton", fused_gemvs=("in", "qkv"))


def test_linear_serving_reads_the_dtype_of_the_projections(tmp_path):
    """from_pretrained keeps a GDN / Mamba-2 mixer's A_log (its first parameter) float32 in a float64 model: the
    serving layer must take the model dtype from its projections (float64 recurrent state; "triton" pre-step
    refused as float64, not picked by "auto" on CUDA)."""
    from hylo_bench.decode.linear_layer import LinearServing
    from hylo_bench.models.cache import map_state

    for kind in ("gdn", "mamba"):
        HyLoForCausalLM(tiny_hybrid_config(**LAYOUTS[kind])).save_pretrained(tmp_path / kind)
        model = HyLoForCausalLM.from_pretrained(tmp_path / kind, dtype=torch.float64)
        mixer = next(layer.mixer for layer in model.model.layers if layer.mixer_type != "mla")
        assert next(mixer.parameters()).dtype == torch.float32  # the premise: A_log first, float32
        srv = LinearServing(mixer, "gdn" if kind == "gdn" else "mamba")
        assert srv.dtype == torch.float64
        tensors: list[torch.Tensor] = []
        map_state(srv.new_state(2), lambda t, out=tensors: out.append(t) or t)
        assert len(tensors) >= 2 and all(t.dtype == torch.float64 for t in tensors)
        if kind == "gdn":
            with pytest.raises(ValueError, match="4-tap convs in float32 / bfloat16 / float16; got conv_size=4, "
                                                 "torch.float64"):
                LinearServing(mixer, "gdn", prestep_backend="triton")


@pytest.mark.parametrize("V,chunk", [(151936, 1024), (1000, 64), (50, 64), (4097, 1024)])
def test_greedy_token_equals_argmax_including_ties(V, chunk):
    from hylo_bench.decode.engine import greedy_token

    gen = torch.Generator().manual_seed(V)
    logits = torch.randint(-3, 4, (3, V), generator=gen).to(torch.bfloat16)  # many ties: first index must win
    logits[1, V - 1] = 9  # the maximum in the padded last chunk
    logits[2, :] = -5
    logits[2, [7, V // 2]] = 2.5
    got = greedy_token(logits, chunk)
    assert torch.equal(got, logits.argmax(-1)) and got.dtype == torch.int64
    assert got[1].item() == V - 1 and got[2].item() == 7


def test_prefill_runs_the_last_layers_mlp_on_the_last_position_only():
    """The last decoder layer of a prefill chunk hands one position to its MLP (the only one the LM head reads);
    every other layer sees the whole chunk (the engine's logits against the full forward: tests above)."""
    model = _model("gdn")
    seen: list[tuple[int, int]] = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: seen.append((i, args[0].shape[1])))
             for i, layer in enumerate(model.model.layers)]
    engine = Engine(model, max_batch=1, max_context=16, prefill_chunk=8, merge_projections=False)
    engine.prefill(torch.randint(3, 97, (1, 11)))
    for h in hooks:
        h.remove()
    last = len(model.model.layers) - 1
    assert seen == [(i, n if i < last else 1) for n in (8, 3) for i in range(last + 1)], seen
