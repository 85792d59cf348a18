"""The Llama-style decoder against independent references: naive attention with explicit
grouped-query head mapping, complex-number RoPE, the RMSNorm formula, the whole decoder (forward
and gradients) against a plain-torch forward written from the architecture, published parameter
counts; causality; meta-device builds of the big presets allocate nothing."""

import math

import pytest
import torch

from flcomm.train.model import (
    MODEL_PRESETS,
    Attention,
    ModelConfig,
    RMSNorm,
    apply_rope,
    build_model,
    get_config,
    lm_loss,
    rope_angles,
)

torch.set_num_threads(1)


def naive_attention(x, attn: Attention, theta: float):
    """Per head, explicit loops: q_h = x Wq_h, k/v from kv head h // (H / Hkv), RoPE via complex
    multiplication, softmax(q k^T / sqrt(d) + causal mask) v."""
    B, T, D = x.shape
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    Wq = attn.wq.weight.view(H, hd, D)
    Wk = attn.wk.weight.view(Hkv, hd, D)
    Wv = attn.wv.weight.view(Hkv, hd, D)
    freqs = theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :])

    def rope(t):  # [B, T, hd], pairs (2i, 2i+1) as complex numbers
        c = torch.view_as_complex(t.double().reshape(B, T, hd // 2, 2).contiguous())
        return torch.view_as_real(c * rot).reshape(B, T, hd)

    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    outs = []
    for h in range(H):
        g = h // (H // Hkv)
        q = rope(x.double() @ Wq[h].double().T)
        k = rope(x.double() @ Wk[g].double().T)
        v = x.double() @ Wv[g].double().T
        a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1)
        outs.append(a @ v)
    y = torch.cat(outs, dim=-1)
    return y @ attn.wo.weight.double().T


def plain_forward(w: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder in plain float64 torch ops from its weights ``w`` (Meta's Llama names):
    embedding; per block ``h = x + attn(rms(x)); out = h + w2(silu(w1 rms(h)) * w3 rms(h))``;
    final RMSNorm; output projection. Attention per head, from kv head ``h // (H / Hkv)``, RoPE as
    complex rotation of pairs (2i, 2i+1) by ``m theta^(-2i / hd)``, causal softmax."""
    B, T = tokens.shape
    H, Hkv, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    pos = torch.arange(T, dtype=torch.float64)[:, None]
    rot = torch.polar(torch.ones(T, hd // 2, dtype=torch.float64), pos * freqs)

    def rope(t):  # [B, T, hd]
        c = torch.view_as_complex(t.reshape(B, T, hd // 2, 2).contiguous())
        return torch.view_as_real(c * rot).reshape(B, T, hd)

    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    x = w["tok_embeddings.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        a = rms(x, w[p + "attention_norm.weight"])
        wq, wk, wv = (w[p + f"attention.{n}.weight"] for n in ("wq", "wk", "wv"))
        heads = []
        for h in range(H):
            g = h // (H // Hkv)
            q = rope(a @ wq[h * hd:(h + 1) * hd].T)
            k = rope(a @ wk[g * hd:(g + 1) * hd].T)
            v = a @ wv[g * hd:(g + 1) * hd].T
            heads.append(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, dim=-1) @ v)
        x = x + torch.cat(heads, dim=-1) @ w[p + "attention.wo.weight"].T
        f = rms(x, w[p + "ffn_norm.weight"])
        gate = f @ w[p + "feed_forward.w1.weight"].T
        up = f @ w[p + "feed_forward.w3.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "feed_forward.w2.weight"].T
    return rms(x, w["norm.weight"]) @ w["output.weight"].T


def test_decoder_matches_plain_torch_forward_and_gradients():
    """The whole model, as tests/dist/test_train_strategies.py's reference uses it: logits, the loss and every
    parameter's gradient against :func:`plain_forward` (autograd through plain float64 ops)."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    model = build_model(cfg, seed=5)
    with torch.no_grad():  # non-trivial norm weights
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randint(0, 64, (2, 13), generator=g), torch.randint(0, 64, (2, 13), generator=g)
    w = {n: p.detach().double().requires_grad_() for n, p in model.named_parameters()}
    ref = plain_forward(w, cfg, x)
    ref_loss = -ref.log_softmax(-1).gather(-1, y[..., None]).mean()
    ref_loss.backward()
    logits = model(x)
    loss = lm_loss(logits, y)
    loss.backward()
    torch.testing.assert_close(logits.double(), ref.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), w[n].grad, atol=1e-5, rtol=1e-3, msg=n)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_attention_matches_naive_gqa_reference(H, Hkv):
    cfg = ModelConfig(dim=8 * H, n_layers=1, n_heads=H, n_kv_heads=Hkv, ffn_dim=64)
    torch.manual_seed(H * 10 + Hkv)
    attn = Attention(cfg)
    for lin in (attn.wq, attn.wk, attn.wv, attn.wo):
        torch.nn.init.normal_(lin.weight, std=0.2)
    x = torch.randn(2, 11, cfg.dim)
    cos, sin = rope_angles(11, cfg.head_dim, cfg.rope_theta)
    got = attn(x, cos, sin)
    ref = naive_attention(x, attn, cfg.rope_theta)
    assert got.shape == (2, 11, cfg.dim)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-4)


def test_gqa_head_mapping_is_not_interleaved():
    """Query head h reads kv head h // n_rep: zeroing kv head 0 changes only heads 0..n_rep-1."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(1, 5, 32)
    cos, sin = rope_angles(5, cfg.head_dim, cfg.rope_theta)
    captured = {}
    attn.wo.register_forward_hook(lambda m, i, o: captured.__setitem__("y", i[0].detach().clone()))
    attn(x, cos, sin)
    before = captured["y"].view(1, 5, 4, 8)
    with torch.no_grad():
        attn.wv.weight[:8].zero_()  # kv head 0
    attn(x, cos, sin)
    after = captured["y"].view(1, 5, 4, 8)
    assert torch.allclose(after[:, :, :2], torch.zeros(1, 5, 2, 8))
    torch.testing.assert_close(after[:, :, 2:], before[:, :, 2:])


def test_rope_properties():
    """Norm-preserving, identity at position 0, and q.k depends only on the position offset."""
    hd, theta = 16, 10000.0
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, hd, dtype=torch.float64), torch.randn(1, 1, 1, hd, dtype=torch.float64)
    cos, sin = rope_angles(40, hd, theta)
    cos, sin = cos.double(), sin.double()

    def at(t, m):
        return apply_rope(t, cos[m:m + 1], sin[m:m + 1])

    torch.testing.assert_close(at(q, 0), q)
    for m in (3, 17, 39):
        torch.testing.assert_close(at(q, m).norm(), q.norm())
    d1 = (at(q, 10) * at(k, 7)).sum()
    d2 = (at(q, 33) * at(k, 30)).sum()
    torch.testing.assert_close(d1, d2, atol=1e-5, rtol=1e-5)
    # the angle of pair i at position m is m * theta^(-2i/hd)
    c, s = rope_angles(3, hd, theta, start=5)
    torch.testing.assert_close(c[0, 1], torch.tensor(math.cos(5 * theta ** (-2 / hd)), dtype=torch.float32))
    torch.testing.assert_close(s[2, 3], torch.tensor(math.sin(7 * theta ** (-6 / hd)), dtype=torch.float32))


def test_rmsnorm_formula():
    torch.manual_seed(2)
    n = RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.randn(12))
    x = torch.randn(3, 4, 12)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * n.weight
    torch.testing.assert_close(n(x), ref)


def test_model_shapes_causality_and_loss():
    model = build_model("tiny", seed=0)
    cfg = model.cfg
    x = torch.randint(0, 256, (2, 24))
    logits = model(x)
    assert logits.shape == (2, 24, cfg.vocab_size) and logits.dtype == torch.float32
    # causal: changing token 10 changes no logit before position 10
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    l2 = model(x2)
    torch.testing.assert_close(l2[:, :10], logits[:, :10])
    assert not torch.allclose(l2[:, 10:], logits[:, 10:])
    # near-uniform at init: loss close to ln(256)
    y = torch.randint(0, 256, (2, 24))
    loss = lm_loss(logits, y)
    assert abs(loss.detach().item() - math.log(256)) < 0.2
    manual = -(logits.double().log_softmax(-1).gather(-1, y[..., None])).mean()
    torch.testing.assert_close(loss.double(), manual, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_same_seed_same_model_and_grad_flows():
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = build_model("tiny", seed=4)
    assert not torch.equal(a.output.weight, c.output.weight)
    x = torch.randint(0, 256, (2, 8))
    lm_loss(a(x[:, :-1]), x[:, 1:]).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters())


@pytest.mark.parametrize("name,expected", [("llama3.1-8b", 8_030_261_248), ("llama3.2-1b", 1_235_814_400)])
def test_big_presets_on_meta_device(name, expected):
    """Published parameter counts of Llama 3.1 8B and Llama 3.2 1B; nothing is allocated."""
    cfg = get_config(name)
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected == cfg.num_params()


def test_presets_sizes_and_config_errors():
    assert 0.5e6 < MODEL_PRESETS["tiny"].num_params() < 1.5e6
    assert MODEL_PRESETS["llama3.1-8b"].n_kv_heads == 8 and MODEL_PRESETS["llama3.1-8b"].ffn_dim == 14336
    assert get_config("tiny", vocab_size=512).vocab_size == 512
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_config("nope")
    with pytest.raises(ValueError, match="n_kv_heads 3 must divide n_heads 4"):
        ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(dim=30, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=8)
    with pytest.raises(ValueError, match="n_layers must be an integer >= 1"):
        ModelConfig(dim=32, n_layers=0, n_heads=4, n_kv_heads=2, ffn_dim=8)
