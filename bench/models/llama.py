"""The LLaMA-style decoder of nn/models/llama.h in plain PyTorch, as HuggingFace transformers'
LlamaForCausalLM computes it (modeling_llama.py): RMSNorm in float32, rotary embeddings with
rotate_half, grouped-query attention through repeat_kv and scaled_dot_product_attention
(is_causal), a SwiGLU MLP, no biases, an untied lm_head. The parameter names are HF's, so
load_state_dict(strict=True) takes Tally's weights (the rotary tables are non-persistent
buffers on both sides).

build(preset) and loss(model, input, target) for tests/nn/check_torch_equivalence.py.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

# LlamaConfig::preset (nn/models/llama.cpp): hidden, ffn, layers, heads, kv heads, context, vocab.
PRESETS = {
    "tiny": dict(hidden=64, ffn=176, layers=2, heads=4, kv_heads=2, context=64, vocab=256),
    "small": dict(hidden=128, ffn=352, layers=4, heads=4, kv_heads=2, context=128, vocab=256),
    "1b": dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, context=2048, vocab=32000),
    "3b": dict(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8, context=2048, vocab=32000),
    "7b": dict(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32, context=4096,
               vocab=32000),
    "13b": dict(hidden=5120, ffn=13824, layers=40, heads=40, kv_heads=40, context=4096,
                vocab=32000),
}
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: the mean square in float32, the weight applied in the input's dtype."""

    def __init__(self, hidden, eps=RMS_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of t * theta^(-2i/D), each frequency in columns i and i + D/2, computed in
    float64 and rounded to float32 once (as Tally's tables are), non-persistent."""

    def __init__(self, head_dim, context, theta=ROPE_THETA):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(context, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(torch.float32), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(torch.float32), persistent=False)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    # q, k [B, H, T, D]; cos, sin [T, D] broadcast over batch and heads.
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    # [B, n_kv, T, D] -> [B, n_kv * n_rep, T, D], head h reading kv head h // n_rep.
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, c, rope):
        super().__init__()
        self.heads, self.kv_heads = c["heads"], c["kv_heads"]
        self.head_dim = c["hidden"] // c["heads"]
        self.q_proj = nn.Linear(c["hidden"], self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c["hidden"], self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c["hidden"], self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c["hidden"], bias=False)
        self._rope = [rope]  # not a submodule: LlamaModel owns it

    def forward(self, x):
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        rope = self._rope[0]
        cos, sin = rope.cos_cached[:t].to(q.dtype), rope.sin_cached[:t].to(q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        n_rep = self.heads // self.kv_heads
        y = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden"], c["ffn"], bias=False)
        self.up_proj = nn.Linear(c["hidden"], c["ffn"], bias=False)
        self.down_proj = nn.Linear(c["ffn"], c["hidden"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c, rope):
        super().__init__()
        self.self_attn = Attention(c, rope)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden"])
        self.post_attention_layernorm = RMSNorm(c["hidden"])

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        rope = RotaryEmbedding(c["hidden"] // c["heads"], c["context"])
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(DecoderLayer(c, rope) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        self.rotary_emb = rope

    def forward(self, idx):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c, initializer_range=0.02):
        super().__init__()
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)
        for m in self.modules():  # HF's _init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=initializer_range)

    def forward(self, idx):
        return self.lm_head(self.model(idx))


def build(preset):
    return LlamaForCausalLM(PRESETS[preset])


def loss(model, input, target):
    logits = model(input)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=-1)


if __name__ == "__main__":  # the parameter counts of the presets (tests/nn/test_llama.cpp's)
    for name, c in PRESETS.items():
        with torch.device("meta"):
            m = build(name)
        print(f"{name}: {sum(p.numel() for p in m.parameters()):,} parameters")
