"""DDPM's diffusion U-Net in plain PyTorch, as nn/models/unet.h builds it in Tally.

The structure of Ho et al.'s model (the PyTorch port pesser/pytorch_diffusion): a sinusoidal
timestep embedding and its MLP, ResBlocks with the time embedding added after conv1, single-head
self-attention at the chosen resolutions and in the middle, stride-2 3x3 convolutions down,
nearest x2 upsampling and a 3x3 convolution up, and every down-path output concatenated into the
up path. Parameter names are Tally's (time_embed.linear_1, down.0.blocks.0.conv1, mid.attn_1.qkv,
up.0.blocks.2.shortcut, norm_out, conv_out, ...).

loss(model, input, target) unpacks the registry's batch: input [B, 2C, H, W] holds x0 (channels
0..C-1) and the noise eps (channels C..2C-1), target [B] int64 the timesteps; the loss is DDPM's
mse(model(sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t), eps) with the linear schedule 1e-4..0.02
over 1000 steps.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "tiny": dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, attn_resolutions=(16,), num_groups=8),
    "ddpm-cifar": dict(ch=128, ch_mult=(1, 2, 2, 2), num_res_blocks=2, attn_resolutions=(16,),
                       num_groups=32),
}


def timestep_embedding(t, dim, dtype):
    # In float64, as Tally computes it, then cast.
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64,
                                                        device=t.device) / (half - 1))
    args = t.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1).to(dtype)


class TimestepEmbedding(nn.Module):
    def __init__(self, ch, temb_ch):
        super().__init__()
        self.ch = ch
        self.linear_1 = nn.Linear(ch, temb_ch)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(temb_ch, temb_ch)

    def forward(self, t):
        emb = timestep_embedding(t, self.ch, self.linear_1.weight.dtype)
        return self.linear_2(self.act(self.linear_1(emb)))


class ResBlock(nn.Module):
    def __init__(self, in_ch, out_ch, temb_ch, num_groups, dropout):
        super().__init__()
        self.norm1 = nn.GroupNorm(num_groups, in_ch)
        self.act = nn.SiLU()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch)
        self.norm2 = nn.GroupNorm(num_groups, out_ch)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x, temb):
        h = self.conv1(self.act(self.norm1(x)))
        h = h + self.temb_proj(self.act(temb))[:, :, None, None]
        h = self.conv2(self.dropout(self.act(self.norm2(h))))
        return (self.shortcut(x) if self.shortcut is not None else x) + h


class AttnBlock(nn.Module):
    def __init__(self, ch, num_groups):
        super().__init__()
        self.norm = nn.GroupNorm(num_groups, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.proj_out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        qkv = self.qkv(self.norm(x)).reshape(B, 3, C, H * W).permute(1, 0, 3, 2)
        h = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B, HW, C]
        h = h.transpose(1, 2).reshape(B, C, H, W)
        return x + self.proj_out(h)


class Downsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return self.conv(self.up(x))


class Level(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        self.attns = nn.ModuleList()
        self.downsample = None
        self.upsample = None


class Mid(nn.Module):
    def __init__(self, ch, temb_ch, num_groups, dropout):
        super().__init__()
        self.block_1 = ResBlock(ch, ch, temb_ch, num_groups, dropout)
        self.attn_1 = AttnBlock(ch, num_groups)
        self.block_2 = ResBlock(ch, ch, temb_ch, num_groups, dropout)


class UNet(nn.Module):
    def __init__(self, in_channels=3, out_channels=3, resolution=32, ch=32, ch_mult=(1, 2),
                 num_res_blocks=1, attn_resolutions=(16,), num_groups=8, dropout=0.0):
        super().__init__()
        self.in_channels, self.resolution = in_channels, resolution
        temb_ch = 4 * ch
        in_mult = (1,) + tuple(ch_mult)
        self.time_embed = TimestepEmbedding(ch, temb_ch)
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        res, block_in = resolution, ch
        for level, mult in enumerate(ch_mult):
            lv = Level()
            block_out = ch * mult
            for _ in range(num_res_blocks):
                lv.blocks.append(ResBlock(block_in, block_out, temb_ch, num_groups, dropout))
                block_in = block_out
                if res in attn_resolutions:
                    lv.attns.append(AttnBlock(block_in, num_groups))
            if level != len(ch_mult) - 1:
                lv.downsample = Downsample(block_in)
                res //= 2
            self.down.append(lv)
        self.mid = Mid(block_in, temb_ch, num_groups, dropout)
        self.up = nn.ModuleList()  # in forward order: the lowest resolution first
        for level in reversed(range(len(ch_mult))):
            lv = Level()
            block_out = ch * ch_mult[level]
            for b in range(num_res_blocks + 1):
                skip_in = ch * in_mult[level] if b == num_res_blocks else block_out
                lv.blocks.append(ResBlock(block_in + skip_in, block_out, temb_ch, num_groups,
                                          dropout))
                block_in = block_out
                if res in attn_resolutions:
                    lv.attns.append(AttnBlock(block_in, num_groups))
            if level != 0:
                lv.upsample = Upsample(block_in)
                res *= 2
            self.up.append(lv)
        self.norm_out = nn.GroupNorm(num_groups, block_in)
        self.act = nn.SiLU()
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, x, t):
        temb = self.time_embed(t)
        hs = [self.conv_in(x)]
        for lv in self.down:
            for b, block in enumerate(lv.blocks):
                h = block(hs[-1], temb)
                if len(lv.attns) > 0:
                    h = lv.attns[b](h)
                hs.append(h)
            if lv.downsample is not None:
                hs.append(lv.downsample(hs[-1]))
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(hs[-1], temb)), temb)
        for lv in self.up:
            for b, block in enumerate(lv.blocks):
                h = block(torch.cat([h, hs.pop()], dim=1), temb)
                if len(lv.attns) > 0:
                    h = lv.attns[b](h)
            if lv.upsample is not None:
                h = lv.upsample(h)
        return self.conv_out(self.act(self.norm_out(h)))


def build(preset):
    return UNet(**PRESETS[preset])


def ddpm_schedule(steps=1000, beta_start=1e-4, beta_end=0.02):
    betas = torch.linspace(beta_start, beta_end, steps, dtype=torch.float64)
    abar = torch.cumprod(1.0 - betas, dim=0)
    return abar.sqrt(), (1.0 - abar).sqrt()


def loss(model, input, target):
    C = input.size(1) // 2
    x0, eps, t = input[:, :C], input[:, C:], target
    sa, s1a = ddpm_schedule()
    a = sa.to(input.device)[t].to(input.dtype).view(-1, 1, 1, 1)
    b = s1a.to(input.device)[t].to(input.dtype).view(-1, 1, 1, 1)
    x_t = x0 * a + eps * b
    return F.mse_loss(model(x_t, t), eps)
