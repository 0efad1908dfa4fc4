"""A small decoder-only transformer in NumPy, forward and hand-written backward.

    embedding -> L x [ RMSNorm -> attention (rotary q, k) -> + ; RMSNorm -> MLP (GELU) -> + ]
              -> RMSNorm -> LM head -> cross-entropy

It runs on any set of tokens with their global positions: the whole sequence
(`attention.Dense`), the N shards of a virtual ring side by side
(`attention.VirtualRing`), or this MPI rank's shard (`attention.MPIRing`). The loss
and gradients it returns are this set's share: the shards' shares add up to the
whole batch's (the caller sums them, with an allreduce on MPI ranks).

Legend: B sequences, c tokens here, d = d_model, H heads, D = d // H, f = d_ff,
V vocabulary, L layers.

    loss, grads = loss_and_grads(params, config, x, y, pos, attn, n_labels)
"""

from dataclasses import asdict, dataclass

import numpy as np

from reference import tms

from . import layers


@dataclass(frozen=True)
class Config:
    vocab: int = 16
    d_model: int = 64
    n_head: int = 4
    n_layer: int = 2
    d_ff: int = 256
    rope_base: float = 10000.0

    @property
    def head_dim(self):
        return self.d_model // self.n_head

    def __post_init__(self):
        if self.d_model % self.n_head or self.head_dim % 2:
            raise ValueError(f"d_model={self.d_model} must be n_head={self.n_head} times an even head dim")

    def linear_flops_per_token(self):
        """Forward matmul FLOPs per token, per layer, the paper's count (section 4):
        8 d^2 (Q, K, V, O) + 4 d f (MLP) + 2 d V / L (LM head, shared over layers)."""
        return tms.linear_flops_per_token(self.d_model, self.d_ff, self.vocab, self.n_layer)

    def as_dict(self):
        return asdict(self)


def init_params(config, seed=0, dtype=np.float64, std=0.02):
    """Parameters by name, GPT-2 style: normal(0, std), residual outputs scaled by 1/sqrt(2L),
    norm gains 1. (Tests use a larger `std`, so that attention is far from uniform.)"""
    rng = np.random.default_rng(seed)
    d, f, V = config.d_model, config.d_ff, config.vocab
    std_out = std / np.sqrt(2 * config.n_layer)
    p = {"wte": rng.normal(0, std, (V, d))}
    for i in range(config.n_layer):
        p |= {f"{i}.norm1": np.ones(d), f"{i}.wq": rng.normal(0, std, (d, d)),
              f"{i}.wk": rng.normal(0, std, (d, d)), f"{i}.wv": rng.normal(0, std, (d, d)),
              f"{i}.wo": rng.normal(0, std_out, (d, d)), f"{i}.norm2": np.ones(d),
              f"{i}.w1": rng.normal(0, std, (d, f)), f"{i}.w2": rng.normal(0, std_out, (f, d))}
    p |= {"norm_f": np.ones(d), "head": rng.normal(0, std, (d, V))}
    return {k: v.astype(dtype) for k, v in p.items()}


def _heads(x, n_head):
    B, c, d = x.shape
    return x.reshape(B, c, n_head, d // n_head)                   # (B, c, H, D)


def attention_block_forward(a, p, i, config, rope, attn):
    """a (B, c, d) normed input -> (B, c, d), the attention sublayer of block i."""
    q, cq = layers.linear_forward(a, p[f"{i}.wq"])
    k, ck = layers.linear_forward(a, p[f"{i}.wk"])
    v, cv = layers.linear_forward(a, p[f"{i}.wv"])
    q, k, v = (_heads(t, config.n_head) for t in (q, k, v))       # (B, c, H, D)
    q, cr = layers.rotary_forward(q, *rope)                       # global positions
    k, _ = layers.rotary_forward(k, *rope)
    out, lse = attn.forward(q, k, v)                              # through the ring
    y, co = layers.linear_forward(out.reshape(a.shape), p[f"{i}.wo"])
    return y, (cq, ck, cv, cr, q, k, v, out, lse, co)


def attention_block_backward(dy, cache, i, attn):
    cq, ck, cv, cr, q, k, v, out, lse, co = cache
    dout, dwo = layers.linear_backward(dy, co)
    dq, dk, dv = attn.backward(q, k, v, out, lse, dout.reshape(out.shape))
    dq, dk = layers.rotary_backward(dq, cr), layers.rotary_backward(dk, cr)
    shape = dy.shape
    da_q, dwq = layers.linear_backward(dq.reshape(shape), cq)
    da_k, dwk = layers.linear_backward(dk.reshape(shape), ck)
    da_v, dwv = layers.linear_backward(dv.reshape(shape), cv)
    grads = {f"{i}.wq": dwq, f"{i}.wk": dwk, f"{i}.wv": dwv, f"{i}.wo": dwo}
    return da_q + da_k + da_v, grads


def mlp_forward(a, p, i):
    h, c1 = layers.linear_forward(a, p[f"{i}.w1"])                # (B, c, f)
    g, cg = layers.gelu_forward(h)
    y, c2 = layers.linear_forward(g, p[f"{i}.w2"])                # (B, c, d)
    return y, (c1, cg, c2)


def mlp_backward(dy, cache, i):
    c1, cg, c2 = cache
    dg, dw2 = layers.linear_backward(dy, c2)
    da, dw1 = layers.linear_backward(layers.gelu_backward(dg, cg), c1)
    return da, {f"{i}.w1": dw1, f"{i}.w2": dw2}


def forward(params, config, x, y, pos, attn, n_labels):
    """This set's share of the loss, and the caches for `backward`.
    x, y (B, c) token ids and labels; pos (c,) the tokens' global positions."""
    p, caches = params, []
    dtype = p["wte"].dtype
    rope = layers.rotary_angles(pos, config.head_dim, config.rope_base, dtype)   # each (c, 1, D/2)
    h, c_emb = layers.embedding_forward(x, p["wte"])              # (B, c, d)
    for i in range(config.n_layer):
        a, cn1 = layers.rmsnorm_forward(h, p[f"{i}.norm1"])
        o, ca = attention_block_forward(a, p, i, config, rope, attn)
        h = h + o
        m, cn2 = layers.rmsnorm_forward(h, p[f"{i}.norm2"])
        o, cm = mlp_forward(m, p, i)
        h = h + o
        caches.append((cn1, ca, cn2, cm))
    hf, cnf = layers.rmsnorm_forward(h, p["norm_f"])
    logits, ch = layers.linear_forward(hf, p["head"])             # (B, c, V)
    loss, cce = layers.cross_entropy_forward(logits, y, n_labels)
    return loss, (c_emb, caches, cnf, ch, cce)


def backward(cache, config, attn):
    """Gradients of this set's share of the loss, by parameter name."""
    c_emb, caches, cnf, ch, cce = cache
    dlogits = layers.cross_entropy_backward(cce)
    dhf, grads = layers.linear_backward(dlogits, ch)
    grads = {"head": grads}
    dh, grads["norm_f"] = layers.rmsnorm_backward(dhf, cnf)
    for i in reversed(range(config.n_layer)):
        cn1, ca, cn2, cm = caches[i]
        dm, g_mlp = mlp_backward(dh, cm, i)                       # residual: dh flows on unchanged
        dx, grads[f"{i}.norm2"] = layers.rmsnorm_backward(dm, cn2)
        dh = dh + dx
        da, g_attn = attention_block_backward(dh, ca, i, attn)
        dx, grads[f"{i}.norm1"] = layers.rmsnorm_backward(da, cn1)
        dh = dh + dx
        grads |= g_mlp | g_attn
    grads["wte"] = layers.embedding_backward(dh, c_emb)
    return grads


def next_tokens(params, config, x, pos, attn):
    """The model's guess for the token after each of these tokens, (B, c): the argmax
    of its logits (the forward pass with every label ignored)."""
    _, (*_, (logits, *_)) = forward(params, config, x, np.full_like(x, layers.IGNORE), pos, attn, n_labels=1)
    return logits.argmax(axis=-1)


def loss_and_grads(params, config, x, y, pos, attn, n_labels):
    """Forward and backward on this set of tokens: (loss share, {name: gradient share})."""
    loss, cache = forward(params, config, x, y, pos, attn, n_labels)
    return loss, backward(cache, config, attn)
