"""The attention rules tools/analyze_attention.py compares on the same captured q and k (``METHODS``; that tool's
docstring says what each is) and the statistics it reports: each rule's attention rows with RoPE off and their
entropy, the N x N weights the model's own attention applies with RoPE on, and Pearson and Spearman
correlations. Rows whose normaliser is 0 (every product zero: possible for the ReLU rules) have no
distribution: they come back as zeros, marked invalid in the mask returned with them."""
import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from models.nala import NALA_EPS, apply_rope, nala_kernel_terms

METHODS = ('nala', 'softmax', 'relu', 'nala_p45')
METHOD_LABELS = {'nala': 'NaLa (as implemented)', 'softmax': 'softmax(q·k/√d)',
                 'relu': 'ReLU linear attention', 'nala_p45': 'NaLa with p fixed at 4.5 (direction only)'}
FIXED_POWER_NORM = 10.0  # tanh(10) = 1 in float32: p = 4.5 exactly


def entropy(rows: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of distributions along the last dim (0 log 0 = 0)."""
    return -torch.xlogy(rows, rows).sum(dim=-1)


def normalise_rows(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative scores (..., N, N) -> rows summing to 1, and a mask of rows that have a
    distribution (positive, finite normaliser). Invalid rows are returned as zeros."""
    total = scores.sum(dim=-1, keepdim=True)
    valid = (total > 0) & torch.isfinite(total)
    rows = torch.where(valid, scores / torch.where(valid, total, torch.ones_like(total)),
                       torch.zeros_like(scores))
    return rows, valid.squeeze(-1)


def nala_rows(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaLa attention rows without RoPE: Q_i.K_j normalised over j, Q, K = nala_kernel_terms(q, k).

    q, k: (..., N, d) raw head queries and keys. Returns rows (..., N, N) and the valid mask (..., N).
    """
    q_feat, k_feat = nala_kernel_terms(q.float(), k.float())
    return normalise_rows(q_feat @ k_feat.transpose(-2, -1))


def nala_fixed_power_rows(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaLa rows with the norm taken out: every query rescaled to ||q|| = 10 (same direction), so the
    model's kernel uses p = 3 (0.5 + tanh 10) = 4.5 for all. A norm-entropy correlation that survives
    here comes from query directions, not from NaLa's norm-dependent power."""
    q = q.float()
    norm = q.norm(dim=-1, keepdim=True)
    return nala_rows(q * torch.where(norm > 0, FIXED_POWER_NORM / norm, torch.ones_like(norm)), k)


def softmax_rows(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) without RoPE; every row is valid."""
    q, k = q.float(), k.float()
    rows = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(dim=-1)
    return rows, torch.ones(rows.shape[:-1], dtype=torch.bool, device=rows.device)


def relu_rows(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ReLU linear attention: relu(q).relu(k_j) normalised over j."""
    return normalise_rows(F.relu(q.float()) @ F.relu(k.float()).transpose(-2, -1))


ROW_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    'nala': nala_rows, 'softmax': softmax_rows, 'relu': relu_rows, 'nala_p45': nala_fixed_power_rows}


def nala_model_weights(q: torch.Tensor, k: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The N x N weights NaLa applies to v in the model (docs/method.md#normaliser-and-linear-time-order),
    RoPE and eps included:
    w_ij = (1/N) Q~_i.K~_j / (Q_i.mean_j K_j + eps), so that out = w @ v. Can be negative."""
    d = q.shape[-1]
    q_feat, k_feat = nala_kernel_terms(q.float(), k.float())
    rope = lambda t: torch.cat([apply_rope(t[..., :d], sin, cos), apply_rope(t[..., d:], sin, cos)], dim=-1)  # noqa: E731
    num = rope(q_feat) @ rope(k_feat).transpose(-2, -1) / q.shape[-2]
    den = q_feat @ k_feat.mean(dim=-2, keepdim=True).transpose(-2, -1) + NALA_EPS
    return num / den


def softmax_model_weights(q: torch.Tensor, k: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The softmax weights of stages 3-4 as the model applies them (RoPE on q and k)."""
    return softmax_rows(apply_rope(q.float(), sin, cos), apply_rope(k.float(), sin, cos))[0]


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get their average rank (scipy.stats.rankdata's default)."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind='mergesort')
    sorted_x = x[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends + 1) / 2.0                      # mean of ranks start+1 .. end
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; NaN when fewer than 2 points or a constant input."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return float('nan')
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    return float((xc * yc).sum() / denom) if denom > 0 else float('nan')


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson of average ranks)."""
    return pearson(rankdata(x), rankdata(y))
