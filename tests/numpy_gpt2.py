"""An independent float64 numpy GPT-2: the reference the C++ core is checked against.

Written from the math, not from csrc/: token + position embedding, L pre-LN blocks
(x += attn(ln1(x)); x += mlp(ln2(x))) with causal multi-head attention and a tanh-GELU MLP of width 4C,
a final LayerNorm, an lm_head tied to wte, and cross-entropy over the first vocab_size logits
(padded columns never enter the softmax), ignoring targets equal to -1. LayerNorm eps is 1e-5.

Parameters use llm.c's layout (config.h): a dict of the 16 tensors, Linear weights stored (out, in),
layers stacked on the first axis. `forward` returns the loss, logits (B, T, Vp) and per-token losses;
`backward` returns the gradient of the mean loss for every tensor, by hand-written backprop.
"""
from __future__ import annotations

import math

import numpy as np

NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
         "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
LN_EPS = 1e-5
GELU_S = math.sqrt(2.0 / math.pi)


def shapes(maxT, V, Vp, L, NH, C):
    """Shapes of the 16 tensors by name (V and NH do not change any shape; kept for a uniform signature)."""
    return {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C), "qkvw": (L, 3 * C, C),
            "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C),
            "fcw": (L, 4 * C, C), "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
            "lnfw": (C,), "lnfb": (C,)}


def random_params(rng, maxT, V, Vp, L, NH, C):
    """Random float64 weights that make every part of the network matter: O(1) embeddings, matmul
    weights ~ 1/sqrt(fan_in) (attention is far from uniform), LayerNorm weights around 1 and biases
    around 0 but neither trivial, and large non-zero padded wte rows (so a softmax that wrongly included
    the padded columns would change the loss)."""
    p = {}
    for name, shp in shapes(maxT, V, Vp, L, NH, C).items():
        if name in ("wte", "wpe"):
            p[name] = 0.3 * rng.standard_normal(shp)
        elif name.endswith("w") and name.startswith("ln"):
            p[name] = 1.0 + 0.3 * rng.standard_normal(shp)
        elif name in ("qkvw", "attprojw", "fcw", "fcprojw"):
            p[name] = rng.standard_normal(shp) / math.sqrt(shp[-1])
        else:  # biases, including LayerNorm biases
            p[name] = 0.2 * rng.standard_normal(shp)
    p["qkvw"] *= 2.0  # sharper attention than the default scale
    p["wte"][V:] = 5.0 + rng.standard_normal((Vp - V, C))
    return p


# ----------------------------------------------------------------------------- building blocks

def layernorm(x, w, b):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + LN_EPS)
    xhat = xc * rstd
    return xhat * w + b, (xhat, rstd, w)


def layernorm_backward(dy, cache):
    xhat, rstd, w = cache
    dxhat = dy * w
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    dw = (dy * xhat).reshape(-1, dy.shape[-1]).sum(0)
    db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return dx, dw, db


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_S * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
    th = np.tanh(GELU_S * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_S * (1.0 + 3 * 0.044715 * x * x)


def attention(qkv, NH):
    """qkv (B, T, 3C) = [q | k | v] -> y (B, T, C), causal softmax(q k^T / sqrt(hs)) v per head."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)              # (B, NH, T, T)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    s = np.where(future, -np.inf, s)
    s = s - s.max(-1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(-1, keepdims=True)
    y = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y, (q, k, v, a, hs)


def attention_backward(dy, cache):
    q, k, v, a, hs = cache
    B, NH, T, _ = q.shape
    dy = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    da = dy @ v.transpose(0, 1, 3, 2)
    dv = a.transpose(0, 1, 3, 2) @ dy
    ds = a * (da - (da * a).sum(-1, keepdims=True)) / math.sqrt(hs)  # masked entries have a == 0
    dq = ds @ k
    dk = ds.transpose(0, 1, 3, 2) @ q
    return np.concatenate([t.transpose(0, 2, 1, 3).reshape(B, T, NH * hs) for t in (dq, dk, dv)], axis=-1)


# ----------------------------------------------------------------------------- the model

def forward(p, idx, targets, V, NH, return_cache=False):
    """Returns (mean loss over targets != -1, logits (B, T, Vp), per-token losses (B, T)).
    targets may be None: loss is NaN and token losses are 0."""
    p = {k: np.asarray(v, dtype=np.float64) for k, v in p.items()}
    idx = np.asarray(idx)
    B, T = idx.shape
    L = p["ln1w"].shape[0]
    x = p["wte"][idx] + p["wpe"][:T]
    layers = []
    for l in range(L):
        h1, c_ln1 = layernorm(x, p["ln1w"][l], p["ln1b"][l])
        qkv = h1 @ p["qkvw"][l].T + p["qkvb"][l]
        y, c_att = attention(qkv, NH)
        x2 = x + y @ p["attprojw"][l].T + p["attprojb"][l]
        h2, c_ln2 = layernorm(x2, p["ln2w"][l], p["ln2b"][l])
        f = h2 @ p["fcw"][l].T + p["fcb"][l]
        g = gelu(f)
        x3 = x2 + g @ p["fcprojw"][l].T + p["fcprojb"][l]
        layers.append((h1, c_ln1, y, c_att, h2, c_ln2, f, g))
        x = x3
    xf, c_lnf = layernorm(x, p["lnfw"], p["lnfb"])
    logits = xf @ p["wte"].T                                      # (B, T, Vp): lm_head tied to wte
    z = logits[..., :V]                                           # padded columns never enter the softmax
    zmax = z.max(-1, keepdims=True)
    lse = (zmax + np.log(np.exp(z - zmax).sum(-1, keepdims=True)))[..., 0]
    if targets is None:
        losses = np.zeros((B, T))
        loss = float("nan")
        valid = np.zeros((B, T), dtype=bool)
    else:
        targets = np.asarray(targets)
        valid = targets != -1
        safe = np.where(valid, targets, 0)
        picked = np.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
        losses = np.where(valid, lse - picked, 0.0)
        n = int(valid.sum())
        loss = losses.sum() / n if n else float("nan")
    if not return_cache:
        return loss, logits, losses
    cache = dict(p=p, idx=idx, layers=layers, xf=xf, c_lnf=c_lnf, logits=logits, lse=lse, valid=valid,
                 targets=targets, V=V, NH=NH)
    return loss, logits, losses, cache


def backward(p, idx, targets, V, NH):
    """Gradient of the mean loss (over targets != -1) with respect to every tensor, by name."""
    loss, logits, losses, c = forward(p, idx, targets, V, NH, return_cache=True)
    p = c["p"]
    B, T = c["idx"].shape
    L = p["ln1w"].shape[0]
    g = {k: np.zeros_like(v) for k, v in p.items()}
    valid = c["valid"]
    n = int(valid.sum())
    if n == 0:
        return g
    # d loss / d logits: (softmax over the first V columns - onehot) / n on valid rows, 0 elsewhere
    dlogits = np.zeros_like(logits)
    dlogits[..., :V] = np.exp(logits[..., :V] - c["lse"][..., None])
    tgt = np.where(valid, c["targets"], 0)
    np.put_along_axis(dlogits, tgt[..., None], np.take_along_axis(dlogits, tgt[..., None], -1) - 1.0, -1)
    dlogits *= valid[..., None] / n
    g["wte"] += dlogits.reshape(-1, dlogits.shape[-1]).T @ c["xf"].reshape(-1, c["xf"].shape[-1])
    dxf = dlogits @ p["wte"]
    dx, g["lnfw"], g["lnfb"] = layernorm_backward(dxf, c["c_lnf"])
    for l in reversed(range(L)):
        h1, c_ln1, y, c_att, h2, c_ln2, f, gl = c["layers"][l]
        # x3 = x2 + fcproj(gelu(fc(ln2(x2))))
        g["fcprojw"][l] = dx.reshape(-1, dx.shape[-1]).T @ gl.reshape(-1, gl.shape[-1])
        g["fcprojb"][l] = dx.reshape(-1, dx.shape[-1]).sum(0)
        dg = dx @ p["fcprojw"][l]
        df = dg * gelu_grad(f)
        g["fcw"][l] = df.reshape(-1, df.shape[-1]).T @ h2.reshape(-1, h2.shape[-1])
        g["fcb"][l] = df.reshape(-1, df.shape[-1]).sum(0)
        dh2 = df @ p["fcw"][l]
        dx2_ln, g["ln2w"][l], g["ln2b"][l] = layernorm_backward(dh2, c_ln2)
        dx2 = dx + dx2_ln
        # x2 = x + attproj(attention(qkv(ln1(x))))
        g["attprojw"][l] = dx2.reshape(-1, dx2.shape[-1]).T @ y.reshape(-1, y.shape[-1])
        g["attprojb"][l] = dx2.reshape(-1, dx2.shape[-1]).sum(0)
        dy = dx2 @ p["attprojw"][l]
        dqkv = attention_backward(dy, c_att)
        g["qkvw"][l] = dqkv.reshape(-1, dqkv.shape[-1]).T @ h1.reshape(-1, h1.shape[-1])
        g["qkvb"][l] = dqkv.reshape(-1, dqkv.shape[-1]).sum(0)
        dh1 = dqkv @ p["qkvw"][l]
        dx_ln, g["ln1w"][l], g["ln1b"][l] = layernorm_backward(dh1, c_ln1)
        dx = dx2 + dx_ln
    np.add.at(g["wte"], c["idx"], dx)
    g["wpe"][:T] += dx.sum(0)
    return g


def adamw(p, g, m, v, step, lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0):
    """One PyTorch-semantics AdamW step, in place on float64 arrays p, m, v: decoupled weight decay
    p -= lr * wd * p (on the pre-step weights), bias-corrected moments, eps outside the square root."""
    m[...] = beta1 * m + (1 - beta1) * g
    v[...] = beta2 * v + (1 - beta2) * g * g
    mhat = m / (1 - beta1 ** step)
    vhat = v / (1 - beta2 ** step)
    p[...] = p - lr * weight_decay * p - lr * mhat / (np.sqrt(vhat) + eps)
