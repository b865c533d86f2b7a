"""GPT-2 in plain PyTorch: the model the torch side of the benchmarks (bench/ddp_torch.py,
bench/profile_torch.py) runs against Tally's nn::GPT. Pre-LayerNorm blocks (causal SDPA, a
GELU(tanh) MLP), tied embeddings; GPT-2 124M by default (vocabulary 50257, T=1024, 12 layers,
d=768, 12 heads).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """GPT-2 block: pre-LayerNorm causal self-attention and a GELU(tanh) MLP."""

    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """forward(idx, targets) returns the mean cross-entropy. init_std: N(0, init_std^2) weights
    for the Linear and Embedding layers (None: PyTorch's default init). float_logits: the loss
    of float32 logits (an explicit cast under autocast)."""

    def __init__(self, V=50257, T=1024, L=12, d=768, h=12, init_std=None, float_logits=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
        self.h = nn.ModuleList(Block(d, h) for _ in range(L))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.float_logits = float_logits
        if init_std is not None:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=init_std)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        if self.float_logits:
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
