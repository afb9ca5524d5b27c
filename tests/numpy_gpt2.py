"""An independent float64 numpy GPT-2: the reference the C++ core is checked against.

Written from the math, not from csrc/: token + position embedding, L pre-LN blocks
(x += attn(ln1(x)); x += mlp(ln2(x))) with causal multi-head attention and a tanh-GELU MLP of width 4C,
a final LayerNorm, an lm_head tied to wte, and cross-entropy over the first vocab_size logits
(padded columns never enter the softmax), ignoring targets equal to -1. LayerNorm eps is 1e-5.

Parameters use llm.c's layout (config.h): a dict of the 16 tensors, Linear weights stored (out, in),
layers stacked on the first axis.

The modern architecture (`arch`, GPT2Config's field names; None = GPT-2), from the papers' math:
position "rope" (no wpe; q and k of each head rotated in the rotate-half layout: for i < hs/2 and
theta = t * base^(-2i/hs), x'[i] = x[i] cos - x[i+hs/2] sin, x'[i+hs/2] = x[i+hs/2] cos + x[i] sin),
norm "rmsnorm" (x / sqrt(mean(x^2) + eps), no gain), qk_norm (that RMSNorm of each head's q and k, after the
rotation), activation "relu2" (relu(x)^2), bias False (no biases in linears or LayerNorms), tie_embeddings
False (a separate lm_head, appended after lnfb), logit_softcap c (logits = c tanh(logits / c), before the loss). `forward` returns the loss, logits (B, T, Vp) and per-token losses;
`backward` returns the gradient of the mean loss for every tensor, by hand-written backprop.
"""
from __future__ import annotations

import math

import numpy as np

NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
         "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
LN_EPS = 1e-5
GELU_S = math.sqrt(2.0 / math.pi)


ARCH = dict(position="learned", rope_base=10000.0, norm="layernorm", qk_norm=False, activation="gelu", bias=True,
            tie_embeddings=True, logit_softcap=None)


def arch_of(arch):
    a = dict(ARCH)
    a.update(arch or {})
    a.pop("zero_init_proj", None)  # an init choice, not math
    return a


def shapes(maxT, V, Vp, L, NH, C, arch=None):
    """Shapes of the tensors the architecture has, by name, in layout order (V and NH do not change any shape;
    kept for a uniform signature)."""
    a = arch_of(arch)
    s = {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C), "qkvw": (L, 3 * C, C),
         "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C), "ln2w": (L, C), "ln2b": (L, C),
         "fcw": (L, 4 * C, C), "fcb": (L, 4 * C), "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
         "lnfw": (C,), "lnfb": (C,), "lm_head": (Vp, C)}
    drop = set()
    if a["position"] == "rope":
        drop.add("wpe")
    if a["norm"] == "rmsnorm":
        drop |= {"ln1w", "ln1b", "ln2w", "ln2b", "lnfw", "lnfb"}
    if not a["bias"]:
        drop |= {"ln1b", "ln2b", "lnfb", "qkvb", "attprojb", "fcb", "fcprojb"}
    if a["tie_embeddings"]:
        drop.add("lm_head")
    return {k: v for k, v in s.items() if k not in drop}


def random_params(rng, maxT, V, Vp, L, NH, C, arch=None):
    """Random float64 weights that make every part of the network matter: O(1) embeddings, matmul
    weights ~ 1/sqrt(fan_in) (attention is far from uniform), LayerNorm weights around 1 and biases
    around 0 but neither trivial, and large non-zero padded wte rows (so a softmax that wrongly included
    the padded columns would change the loss)."""
    p = {}
    for name, shp in shapes(maxT, V, Vp, L, NH, C, arch).items():
        if name in ("wte", "wpe", "lm_head"):
            p[name] = 0.3 * rng.standard_normal(shp)
        elif name.endswith("w") and name.startswith("ln"):
            p[name] = 1.0 + 0.3 * rng.standard_normal(shp)
        elif name in ("qkvw", "attprojw", "fcw", "fcprojw"):
            p[name] = rng.standard_normal(shp) / math.sqrt(shp[-1])
        else:  # biases, including LayerNorm biases
            p[name] = 0.2 * rng.standard_normal(shp)
    p["qkvw"] *= 2.0  # sharper attention than the default scale
    p["wte"][V:] = 5.0 + rng.standard_normal((Vp - V, C))
    if "lm_head" in p:
        p["lm_head"][V:] = 5.0 + rng.standard_normal((Vp - V, C))
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


def rmsnorm(x):
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + LN_EPS)
    return x * r, (x * r, r)


def rmsnorm_backward(dy, cache):
    xhat, r = cache
    return r * (dy - xhat * (dy * xhat).mean(-1, keepdims=True))


def rope_tables(T, hs, base):
    """cos, sin of theta[t, i] = t * base^(-2i/hs), (T, hs/2)."""
    inv = base ** (-2.0 * np.arange(hs // 2) / hs)
    theta = np.arange(T)[:, None] * inv[None, :]
    return np.cos(theta), np.sin(theta)


def rope(x, cos, sin):
    """x (..., T, hs) rotated in the rotate-half layout."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def relu2(x):
    return np.maximum(x, 0.0) ** 2


def relu2_grad(x):
    return 2.0 * np.maximum(x, 0.0)


def gelu(x):
    return 0.5 * x * (1.0 + np.tanh(GELU_S * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
    th = np.tanh(GELU_S * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * GELU_S * (1.0 + 3 * 0.044715 * x * x)


def attention(qkv, NH, arch=None):
    """qkv (B, T, 3C) = [q | k | v] -> y (B, T, C), causal softmax(q k^T / sqrt(hs)) v per head (q and k
    rotated, then RMS-normalised, when the architecture says so)."""
    a = arch_of(arch)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
    rot = rope_tables(T, hs, a["rope_base"]) if a["position"] == "rope" else None
    if rot is not None:
        q, k = rope(q, *rot), rope(k, *rot)
    qn = kn = None
    if a["qk_norm"]:
        (q, qn), (k, kn) = rmsnorm(q), rmsnorm(k)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)              # (B, NH, T, T)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    s = np.where(future, -np.inf, s)
    s = s - s.max(-1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(-1, keepdims=True)
    y = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return y, (q, k, v, a, hs, rot, qn, kn)


def attention_backward(dy, cache):
    q, k, v, a, hs, rot, qn, kn = cache
    B, NH, T, _ = q.shape
    dy = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    da = dy @ v.transpose(0, 1, 3, 2)
    dv = a.transpose(0, 1, 3, 2) @ dy
    ds = a * (da - (da * a).sum(-1, keepdims=True)) / math.sqrt(hs)  # masked entries have a == 0
    dq = ds @ k
    dk = ds.transpose(0, 1, 3, 2) @ q
    if qn is not None:
        dq, dk = rmsnorm_backward(dq, qn), rmsnorm_backward(dk, kn)
    if rot is not None:  # the transpose of a rotation: the rotation by -theta
        cos, sin = rot
        dq, dk = rope(dq, cos, -sin), rope(dk, cos, -sin)
    return np.concatenate([t.transpose(0, 2, 1, 3).reshape(B, T, NH * hs) for t in (dq, dk, dv)], axis=-1)


# ----------------------------------------------------------------------------- the model

def _norm(x, p, w, b, a):
    """The architecture's norm: LayerNorm (weight, bias when present) or RMSNorm (no parameters)."""
    if a["norm"] == "rmsnorm":
        y, c = rmsnorm(x)
        return y, ("rms", c)
    y, c = layernorm(x, w, b if b is not None else 0.0)
    return y, ("ln", c)


def _norm_backward(dy, cache):
    """(dx, dw, db) of _norm (dw, db None for RMSNorm)."""
    kind, c = cache
    if kind == "rms":
        return rmsnorm_backward(dy, c), None, None
    return layernorm_backward(dy, c)


def forward(p, idx, targets, V, NH, return_cache=False, arch=None):
    """Returns (mean loss over targets != -1, logits (B, T, Vp), per-token losses (B, T)); the logits are
    soft-capped when the architecture caps them. targets may be None: loss is NaN and token losses are 0."""
    a = arch_of(arch)
    p = {k: np.asarray(v, dtype=np.float64) for k, v in p.items()}
    idx = np.asarray(idx)
    B, T = idx.shape
    L = p["qkvw"].shape[0]
    lw = lambda name, l=None: None if name not in p else (p[name] if l is None else p[name][l])  # noqa: E731
    bias = lambda name, l: p[name][l] if name in p else 0.0  # noqa: E731
    act, act_grad = (relu2, relu2_grad) if a["activation"] == "relu2" else (gelu, gelu_grad)
    x = p["wte"][idx] + (p["wpe"][:T] if a["position"] == "learned" else 0.0)
    layers = []
    for l in range(L):
        h1, c_ln1 = _norm(x, p, lw("ln1w", l), lw("ln1b", l), a)
        qkv = h1 @ p["qkvw"][l].T + bias("qkvb", l)
        y, c_att = attention(qkv, NH, a)
        x2 = x + y @ p["attprojw"][l].T + bias("attprojb", l)
        h2, c_ln2 = _norm(x2, p, lw("ln2w", l), lw("ln2b", l), a)
        f = h2 @ p["fcw"][l].T + bias("fcb", l)
        g = act(f)
        x3 = x2 + g @ p["fcprojw"][l].T + bias("fcprojb", l)
        layers.append((h1, c_ln1, y, c_att, h2, c_ln2, f, g))
        x = x3
    xf, c_lnf = _norm(x, p, lw("lnfw"), lw("lnfb"), a)
    head = p["wte"] if a["tie_embeddings"] else p["lm_head"]
    logits = xf @ head.T                                          # (B, T, Vp)
    cap = a["logit_softcap"]
    if cap:
        logits = cap * np.tanh(logits / cap)
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
                 targets=targets, V=V, NH=NH, a=a, act_grad=act_grad)
    return loss, logits, losses, cache


def backward(p, idx, targets, V, NH, arch=None):
    """Gradient of the mean loss (over targets != -1) with respect to every tensor, by name."""
    loss, logits, losses, c = forward(p, idx, targets, V, NH, return_cache=True, arch=arch)
    p, a, act_grad = c["p"], c["a"], c["act_grad"]
    B, T = c["idx"].shape
    L = p["qkvw"].shape[0]
    g = {k: np.zeros_like(v) for k, v in p.items()}
    valid = c["valid"]
    n = int(valid.sum())
    if n == 0:
        return g

    def put(name, l, value):  # a gradient of a tensor the architecture has
        if value is not None and name in g:
            g[name][l] = value

    def rows(t):
        return t.reshape(-1, t.shape[-1])

    # d loss / d logits: (softmax over the first V columns - onehot) / n on valid rows, 0 elsewhere
    dlogits = np.zeros_like(logits)
    dlogits[..., :V] = np.exp(logits[..., :V] - c["lse"][..., None])
    tgt = np.where(valid, c["targets"], 0)
    np.put_along_axis(dlogits, tgt[..., None], np.take_along_axis(dlogits, tgt[..., None], -1) - 1.0, -1)
    dlogits *= valid[..., None] / n
    cap = a["logit_softcap"]
    if cap:  # logits = cap tanh(z / cap): dz = dlogits (1 - (logits / cap)^2)
        dlogits = dlogits * (1.0 - (logits / cap) ** 2)
    head = "wte" if a["tie_embeddings"] else "lm_head"
    g[head] += rows(dlogits).T @ rows(c["xf"])
    dxf = dlogits @ p[head]
    dx, dw, db = _norm_backward(dxf, c["c_lnf"])
    put("lnfw", Ellipsis, dw)
    put("lnfb", Ellipsis, db)
    for l in reversed(range(L)):
        h1, c_ln1, y, c_att, h2, c_ln2, f, gl = c["layers"][l]
        # x3 = x2 + fcproj(act(fc(ln2(x2))))
        g["fcprojw"][l] = rows(dx).T @ rows(gl)
        put("fcprojb", l, rows(dx).sum(0))
        dg = dx @ p["fcprojw"][l]
        df = dg * act_grad(f)
        g["fcw"][l] = rows(df).T @ rows(h2)
        put("fcb", l, rows(df).sum(0))
        dh2 = df @ p["fcw"][l]
        dx2_ln, dw, db = _norm_backward(dh2, c_ln2)
        put("ln2w", l, dw)
        put("ln2b", l, db)
        dx2 = dx + dx2_ln
        # x2 = x + attproj(attention(qkv(ln1(x))))
        g["attprojw"][l] = rows(dx2).T @ rows(y)
        put("attprojb", l, rows(dx2).sum(0))
        dy = dx2 @ p["attprojw"][l]
        dqkv = attention_backward(dy, c_att)
        g["qkvw"][l] = rows(dqkv).T @ rows(h1)
        put("qkvb", l, rows(dqkv).sum(0))
        dh1 = dqkv @ p["qkvw"][l]
        dx_ln, dw, db = _norm_backward(dh1, c_ln1)
        put("ln1w", l, dw)
        put("ln1b", l, db)
        dx = dx2 + dx_ln
    np.add.at(g["wte"], c["idx"], dx)
    if "wpe" in g:
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
