"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, grouped-query attention.

The layout follows Meta's reference Llama (``tok_embeddings``, ``layers.i.attention.wq/wk/wv/wo``,
``layers.i.feed_forward.w1/w2/w3``, ``norm``, ``output``), so the FSDP2 wrapping unit is one
:class:`TransformerBlock`. Presets run from about a million parameters (CPU tests) to the
Llama 3.1 8B shape; big presets are built on the meta device and materialized after sharding
(:func:`build_model` with ``device="meta"``, then ``to_empty`` and :meth:`Transformer.init_weights`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flcomm._lazy import renamed_attributes
from flcomm.validate import integer


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder.

    Args:
        dim: model (residual stream) width.
        n_layers: decoder blocks.
        n_heads: query heads; ``dim`` must be a multiple of it.
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_dim: hidden width of the SwiGLU feed-forward.
        vocab_size: embedding rows; 256 for the byte-level tokenizer (the default).
        max_seq_len: longest sequence the model is meant for (checked in ``forward``).
        rope_theta: base of the rotary frequencies.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the input embedding and the output projection.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 256
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            integer(f"ModelConfig.{name}", getattr(self, name), 1)
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads} "
                             "(grouped-query attention shares each kv head among n_heads / n_kv_heads "
                             "query heads)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads must be even for rotary embeddings, got "
                             f"{self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count from the shapes (no model needed)."""
        hd = self.head_dim
        attn = self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2
        ffn = 3 * self.dim * self.ffn_dim
        block = attn + ffn + 2 * self.dim
        emb = self.vocab_size * self.dim
        return self.n_layers * block + self.dim + emb * (1 if self.tie_embeddings else 2)

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # ~0.9 M parameters: CPU tests and the two-minute comparison.
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=1024),
    # ~4.8 M parameters: CPU runs that still learn visibly in minutes.
    "small": ModelConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=1024),
    # ~76 M parameters: a GPU smoke test.
    "base": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=2048),
    # Llama 3.2 1B shape (vocab of the Llama 3 tokenizer).
    "llama3.2-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                               vocab_size=128256, max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    # Llama 3.1 8B shape: 8.03 B parameters.
    "llama3.1-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                               vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
}

# NOTE: the old name, for one release
__getattr__ = renamed_attributes(__name__, {"PRESETS": "MODEL_PRESETS"})


def get_config(name: str, **overrides: object) -> ModelConfig:
    """The preset ``name``, with fields replaced by ``overrides`` (e.g. ``vocab_size=256``)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}")
    cfg = MODEL_PRESETS[name]
    return replace(cfg, **overrides) if overrides else cfg


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_angles(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None,
                start: int = 0) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each [seq_len, head_dim / 2] in fp32.

    Pair i of a head (elements 2i and 2i+1) at position m rotates by ``m * theta^(-2i / head_dim)``.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(start, start + seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(pos, freqs)
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x`` [B, T, H, head_dim] (Meta's interleaved layout).

    Equivalent to multiplying the complex numbers ``x[2i] + j x[2i+1]`` by ``exp(j angle_i)``.
    """
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    Steps: project to ``n_heads`` queries and ``n_kv_heads`` keys/values; rotate q and k; repeat
    each kv head for its ``n_heads / n_kv_heads`` query heads (query head h reads kv head
    ``h // n_rep``); causal scaled dot-product attention; output projection.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, hd]
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:
            # NOTE: repeat_interleave rather than SDPA's enable_gqa: same math on every torch
            # from 2.11 and every backend (the CPU math kernel included).
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``. The FSDP unit."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection.

    ``forward(tokens [B, T]) -> logits [B, T, vocab]`` (fp32).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.cfg.max_seq_len}")
        # NOTE: the angles are recomputed per call (T * head_dim / 2 values): no buffers, so a
        # model built on the meta device needs nothing re-created after to_empty().
        cos, sin = rope_angles(T, self.cfg.head_dim, self.cfg.rope_theta, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialize every parameter in place (also sharded DTensors after ``to_empty``).

        Normal(0, std) for embeddings and projections; the projections that write into the
        residual stream (``wo``, ``w2``) get std / sqrt(2 n_layers) (GPT-2 scaling); norms 1.
        """
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, m in self.named_modules():
            if isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, nn.Linear):
                if name.endswith(("wo", "w2")):
                    nn.init.normal_(m.weight, 0.0, out_std)
                elif not (self.cfg.tie_embeddings and m is self.output):
                    nn.init.normal_(m.weight, 0.0, std)


def build_model(cfg: ModelConfig | str, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Build a :class:`Transformer`.

    On ``device="meta"`` nothing is allocated (any size, e.g. "llama3.1-8b"); the caller shards
    the model, calls ``to_empty(device=...)`` and then :meth:`Transformer.init_weights`.
    Otherwise the weights are initialized at once from ``seed`` (None: the current RNG), so
    every rank that builds with the same seed holds the same model.
    """
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    device = torch.device(device)
    with torch.device(device):
        model = Transformer(cfg)
    if device.type != "meta":
        if seed is None:
            model.init_weights()
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model.init_weights()
    return model


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
