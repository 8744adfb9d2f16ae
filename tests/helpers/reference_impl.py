"""An independent, functional transcription of the reference NaLaFormer forward pass, and the
name-seeded weights of docs/method.md#reference-test-vector.

It shares no code with ``models/``: it reads a state dict by key and follows the reference's
layout (channels-last tokens inside a block, einops head splits, RMT-style RoPE tables). Tests
compare our timm model against it, so a mistake has to be made twice, independently, to pass.
"""
import math
import zlib

import torch
import torch.nn.functional as F
from einops import rearrange

# dims, depths, heads, mlp ratio (docs/method.md#variants); the shipped variants are all hybrid (2 NaLa stages).
ARCH = {
    'NALAFORMER_XT': ((32, 64, 128, 384), (2, 2, 2, 2), (1, 2, 4, 12), 3.5),
    'NALAFORMER_T': ((64, 128, 256, 512), (2, 2, 6, 2), (1, 2, 4, 8), 4.0),
    'NALAFORMER_S': ((64, 128, 320, 512), (3, 5, 9, 3), (1, 2, 5, 8), 3.5),
    'NALAFORMER_B': ((96, 192, 384, 512), (4, 6, 12, 6), (1, 2, 6, 8), 4.0),
    'NALAFORMER_L': ((96, 192, 448, 640), (4, 7, 19, 8), (1, 2, 7, 10), 3.5),
}


def read_keys(path: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Rows of a ``*.keys.txt`` file: (key, shape, dtype name)."""
    rows = []
    with open(path) as f:
        for line in f:
            key, shape, dtype = line.rstrip('\n').split('\t')
            rows.append((key, () if shape == 'scalar' else tuple(int(s) for s in shape.split('x')), dtype))
    return rows


def seeded_state_dict(rows: list[tuple[str, tuple[int, ...], str]]) -> dict[str, torch.Tensor]:
    """The name-seeded weights of docs/method.md#reference-test-vector, in key order."""
    sd = {}
    for key, shape, _ in rows:
        if key.endswith('num_batches_tracked'):
            sd[key] = torch.zeros(shape, dtype=torch.int64)
            continue
        if key.endswith('.angle'):
            m = shape[0] // 2
            sd[key] = (1.0 / (10000 ** torch.linspace(0, 1, m))).unsqueeze(-1).repeat(1, 2).flatten()
            continue
        r = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
        leaf = key.rsplit('.', 1)[-1]
        if leaf == 'running_var':
            value = 1 + 0.5 * r.abs()
        elif leaf == 'running_mean':
            value = 0.1 * r
        elif key.endswith('bias'):
            value = 0.02 * r
        elif leaf.startswith('gamma_'):
            value = 0.5 + 0.1 * r
        elif len(shape) == 1:
            value = 1 + 0.1 * r
        else:
            value = r / math.sqrt(r[0].numel())
        sd[key] = value
    return sd


# ---- the reference forward, functional ----------------------------------------------------------

def _rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack([-x2, x1], dim=-1).flatten(-2)


def _theta_shift(x, sin, cos):
    return x * cos + _rotate_every_two(x) * sin


def _rope_tables(angle, h, w):
    index_h = torch.arange(h).to(angle)
    index_w = torch.arange(w).to(angle)
    sin_h = torch.sin(index_h[:, None] * angle[None, :]).unsqueeze(1).repeat(1, w, 1)
    sin_w = torch.sin(index_w[:, None] * angle[None, :]).unsqueeze(0).repeat(h, 1, 1)
    cos_h = torch.cos(index_h[:, None] * angle[None, :]).unsqueeze(1).repeat(1, w, 1)
    cos_w = torch.cos(index_w[:, None] * angle[None, :]).unsqueeze(0).repeat(h, 1, 1)
    return torch.cat([sin_h, sin_w], -1), torch.cat([cos_h, cos_w], -1)   # (h, w, d)


def _bn(x, sd, p):
    return F.batch_norm(x, sd[p + '.running_mean'], sd[p + '.running_var'], sd[p + '.weight'],
                        sd[p + '.bias'], False, 0.0, 1e-5)


def _attention(x, sd, p, num_heads, linear, sin, cos):
    """x: (b, h, w, c) channels-last."""
    b, h, w, c = x.shape
    d = c // num_heads
    n = h * w
    qkvg = F.linear(x, sd[p + 'qkvg.weight'], sd[p + 'qkvg.bias'])
    q, k, v, g = torch.chunk(qkvg, 4, dim=-1)
    lepe = F.conv2d(v.permute(0, 3, 1, 2), sd[p + 'lepe.weight'], sd[p + 'lepe.bias'], padding=2, groups=c)
    lepe = lepe.permute(0, 2, 3, 1)
    if linear:
        q, k, v = (rearrange(t, 'b h w (m d) -> b m (h w) d', m=num_heads) for t in (q, k, v))
        sin_t, cos_t = sin.reshape(n, d), cos.reshape(n, d)
        k = k ** 3
        q_norm = q.norm(dim=-1, keepdim=True)
        power = 3 * (0.5 + torch.tanh(q_norm))
        q_pos = (F.relu(q) / q_norm) ** power
        q_neg = (F.relu(-q) / q_norm) ** power
        k_pos, k_neg = F.relu(k), F.relu(-k)
        q_sim = torch.cat([q_pos, q_neg], dim=-1)
        k_sim = torch.cat([k_pos, k_neg], dim=-1)
        q_rope = torch.cat([_theta_shift(q_pos, sin_t, cos_t), _theta_shift(q_neg, sin_t, cos_t)], dim=-1)
        k_rope = torch.cat([_theta_shift(k_pos, sin_t, cos_t), _theta_shift(k_neg, sin_t, cos_t)], dim=-1)
        z = 1 / (torch.einsum('bmnc,bmc->bmn', q_sim, k_sim.mean(dim=-2)) + 1e-6)
        kv = torch.einsum('bmnc,bmne->bmce', k_rope * n ** -0.5, v * n ** -0.5)
        o = torch.einsum('bmnc,bmce->bmne', q_rope, kv) * z.unsqueeze(-1)
        o = rearrange(o, 'b m (h w) d -> b h w (m d)', h=h, w=w)
    else:
        q, k, v = (rearrange(t, 'b h w (m d) -> b m h w d', m=num_heads) for t in (q, k, v))
        q, k = _theta_shift(q, sin, cos), _theta_shift(k, sin, cos)
        q, k, v = (t.flatten(2, 3) for t in (q, k, v))
        attn = torch.softmax(q @ k.transpose(-1, -2) * d ** -0.5, dim=-1)
        o = rearrange(attn @ v, 'b m (h w) d -> b h w (m d)', h=h, w=w)
    o = F.layer_norm(o + lepe, (c,), sd[p + 'ln.weight'], sd[p + 'ln.bias'], 1e-5) * F.silu(g)
    return F.linear(o, sd[p + 'out_proj.weight'], sd[p + 'out_proj.bias'])


def reference_forward(sd: dict[str, torch.Tensor], variant: str, x: torch.Tensor) -> torch.Tensor:
    """Logits of the reference model (eval mode) for state dict ``sd`` and images ``x``."""
    dims, depths, heads, mlp_ratio = ARCH[variant]
    pe = 'patch_embed.proj.'
    for conv_i, stride, act in ((0, 2, True), (3, 1, True), (6, 1, True), (9, 2, False)):
        x = F.conv2d(x, sd[f'{pe}{conv_i}.weight'], sd[f'{pe}{conv_i}.bias'], stride, 1)
        x = _bn(x, sd, f'{pe}{conv_i + 1}')
        x = F.gelu(x) if act else x
    for s in range(4):
        c = dims[s]
        _, _, h, w = x.shape
        sin, cos = _rope_tables(sd[f'layers.{s}.RoPE.angle'], h, w)
        for i in range(depths[s]):
            p = f'layers.{s}.blocks.{i}.'
            x = x + F.conv2d(x, sd[p + 'cpe1.weight'], sd[p + 'cpe1.bias'], padding=1, groups=c)
            y = F.layer_norm(x.permute(0, 2, 3, 1), (c,), sd[p + 'norm1.norm.weight'], sd[p + 'norm1.norm.bias'], 1e-6)
            y = _attention(y, sd, p + 'attn.', heads[s], s < 2, sin, cos)
            x = x + sd[p + 'gamma_1'] * y.permute(0, 3, 1, 2)
            x = x + F.conv2d(x, sd[p + 'cpe2.weight'], sd[p + 'cpe2.bias'], padding=1, groups=c)
            y = F.layer_norm(x.permute(0, 2, 3, 1), (c,), sd[p + 'norm2.norm.weight'], sd[p + 'norm2.norm.bias'], 1e-6)
            y = F.gelu(F.linear(y, sd[p + 'ffn.fc1.weight'], sd[p + 'ffn.fc1.bias'])).permute(0, 3, 1, 2)
            y = y + F.conv2d(y, sd[p + 'ffn.dwconv.weight'], sd[p + 'ffn.dwconv.bias'], padding=1,
                             groups=y.shape[1])
            y = F.linear(y.permute(0, 2, 3, 1), sd[p + 'ffn.fc2.weight'], sd[p + 'ffn.fc2.bias'])
            x = x + sd[p + 'gamma_2'] * y.permute(0, 3, 1, 2)
        if s < 3:
            x = F.conv2d(x, sd[f'layers.{s}.downsample.reduction.weight'],
                         sd[f'layers.{s}.downsample.reduction.bias'], 2, 1)
            x = _bn(x, sd, f'layers.{s}.downsample.norm')
    x = F.linear(x.permute(0, 2, 3, 1), sd['proj.weight'], sd['proj.bias']).permute(0, 3, 1, 2)
    x = F.silu(_bn(x, sd, 'norm'))
    x = x.mean(dim=(2, 3), keepdim=True)
    return F.conv2d(x, sd['head.weight'], sd['head.bias']).flatten(1)
