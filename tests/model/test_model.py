"""The model: each layer against finite differences, the recipe, and the whole model
over the ring against the dense model on one process.

Sizes are tiny (S = 16 tokens, d = 16, two heads, two layers, V = 11): the dense
oracle builds the whole (S, S) score matrix and the finite differences run the
model twice per checked entry. Parameters are drawn with std 0.3 (not the training
init's 0.02), so that attention is far from uniform and a wrong position or a
wrong mask changes the loss visibly.

    .venv/bin/python -m pytest tests/model/test_model.py -q
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reference
from mpi_impl.launch import find_mpiexec
from conftest import assert_close
from model import layers, recipe, speedup, train, transformer
from model.attention import Dense, VirtualRing

ROOT = Path(__file__).resolve().parents[2]
CONFIG = transformer.Config(vocab=11, d_model=16, n_head=2, n_layer=2, d_ff=32)
B, S, PERIOD, STD, SEED = 2, 16, 4, 0.3, 0
TILE = 2                          # tiles of 2 x 2: blocks of 4 to 16 tokens get skipped and masked tiles
FD_EPS, FD_TOL = 1e-6, 1e-7       # central differences in float64: error ~ eps^2 * f''' + 1e-16 / eps
RING_DEVICES = (1, 2, 4)


def tokens(seed=SEED):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab, (B, S + 1))


def params(std=STD):
    return transformer.init_params(CONFIG, SEED, std=std)


def dense_loss_and_grads(p, toks, **kw):
    return train.dense(CONFIG, ignore_first=PERIOD - 1, **kw).loss_and_grads(p, toks)


# -- each layer against finite differences ------------------------------------------

def numeric_grad(f, x, rng, n_entries=12):
    """d f / d x at a few random entries of x, by central differences; (indices, values)."""
    idx = [tuple(rng.integers(0, s) for s in x.shape) for _ in range(n_entries)]
    values = []
    for i in idx:
        saved = x[i]
        x[i] = saved + FD_EPS
        up = f()
        x[i] = saved - FD_EPS
        down = f()
        x[i] = saved
        values.append((up - down) / (2 * FD_EPS))
    return idx, np.array(values)


def check_fd(f, x, grad, rng, what):
    idx, want = numeric_grad(f, x, rng)
    got = np.array([grad[i] for i in idx])
    np.testing.assert_allclose(got, want, atol=FD_TOL, rtol=1e-6, err_msg=what)


def test_layer_linear_rmsnorm_gelu_rotary_against_finite_differences():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 8))
    r = rng.standard_normal((2, 5, 8))             # the scalar checked: sum(y * r)
    w = rng.standard_normal((8, 8))
    g = rng.standard_normal(8)

    def lin():
        return (layers.linear_forward(x, w)[0] * r).sum()
    dx, dw = layers.linear_backward(r, layers.linear_forward(x, w)[1])
    check_fd(lin, x, dx, rng, "linear dx")
    check_fd(lin, w, dw, rng, "linear dw")

    def norm():
        return (layers.rmsnorm_forward(x, g)[0] * r).sum()
    dx, dg = layers.rmsnorm_backward(r, layers.rmsnorm_forward(x, g)[1])
    check_fd(norm, x, dx, rng, "rmsnorm dx")
    check_fd(norm, g, dg, rng, "rmsnorm dg")

    def gelu():
        return (layers.gelu_forward(x)[0] * r).sum()
    check_fd(gelu, x, layers.gelu_backward(r, layers.gelu_forward(x)[1]), rng, "gelu dx")

    xh, rh = x.reshape(2, 5, 2, 4), r.reshape(2, 5, 2, 4)        # (B, c, H, D)
    rope = layers.rotary_angles(np.array([0, 7, 3, 12, 5]), 4)

    def rot():
        return (layers.rotary_forward(xh, *rope)[0] * rh).sum()
    check_fd(rot, xh, layers.rotary_backward(rh, layers.rotary_forward(xh, *rope)[1]), rng, "rotary dx")


def test_layer_embedding_and_cross_entropy_against_finite_differences():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 6, (2, 5))
    wte = rng.standard_normal((6, 3))
    r = rng.standard_normal((2, 5, 3))

    def emb():
        return (layers.embedding_forward(ids, wte)[0] * r).sum()
    check_fd(emb, wte, layers.embedding_backward(r, layers.embedding_forward(ids, wte)[1]), rng, "embedding")

    logits = rng.standard_normal((2, 5, 6))
    labels = rng.integers(0, 6, (2, 5))
    labels[0, :2] = layers.IGNORE

    def ce():
        return layers.cross_entropy_forward(logits, labels, 17)[0]
    dlogits = layers.cross_entropy_backward(layers.cross_entropy_forward(logits, labels, 17)[1])
    check_fd(ce, logits, dlogits, rng, "cross-entropy")
    assert not dlogits[0, :2].any(), "an ignored label must give no gradient"


def test_rotary_is_relative():
    # q.k after rotation depends on the positions only through their difference
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 1, 1, 1, 8))
    rot = lambda x, p: layers.rotary_forward(x, *layers.rotary_angles(np.array([p]), 8))[0]
    assert np.isclose((rot(q, 9) * rot(k, 4)).sum(), (rot(q, 105) * rot(k, 100)).sum())
    assert not np.isclose((rot(q, 9) * rot(k, 4)).sum(), (rot(q, 9) * rot(k, 5)).sum())


def test_whole_model_against_finite_differences():
    """The model's assembly (residuals, heads, tied caches) on the dense oracle."""
    p, toks, rng = params(), tokens(), np.random.default_rng(4)
    _, grads = dense_loss_and_grads(p, toks)
    for name in ("wte", "0.wq", "0.wk", "0.wv", "0.wo", "0.norm1", "1.w1", "1.w2", "1.norm2",
                 "norm_f", "head"):
        check_fd(lambda: dense_loss_and_grads(p, toks)[0], p[name], grads[name], rng, name)


# -- the recipe ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", reference.LAYOUTS)
def test_labels_are_shifted_then_sharded(layout):
    toks = tokens()
    for shard in recipe.shift_then_shard(toks, 4, layout, ignore_first=3):
        np.testing.assert_array_equal(shard.x, toks[:, shard.pos])
        want = np.where(shard.pos < 3, layers.IGNORE, toks[:, shard.pos + 1])
        np.testing.assert_array_equal(shard.y, want)     # each token's label is the NEXT global token


# -- the whole model over the ring = the dense model -----------------------------------

def assert_same_loss_and_grads(got, want, what):
    (loss, grads), (want_loss, want_grads) = got, want
    assert_close(loss, want_loss, np.float64, what=f"loss {what}")
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        assert_close(grads[name], want_grads[name], np.float64, what=f"d {name} {what}")


@pytest.mark.parametrize("layout", reference.LAYOUTS)
@pytest.mark.parametrize("n", RING_DEVICES)
def test_virtual_ring_model_equals_dense(n, layout):
    p, toks = params(), tokens()
    replica = train.virtual(CONFIG, n, layout, tile_size=TILE, ignore_first=PERIOD - 1)
    assert_same_loss_and_grads(replica.loss_and_grads(p, toks), dense_loss_and_grads(p, toks),
                               f"N={n} {layout}")


def test_local_positions_give_a_different_loss():
    """The mistake the recipe avoids: rotary embeddings from each device's LOCAL index."""
    p, toks, n = params(), tokens(), 4
    want, _ = dense_loss_and_grads(p, toks)
    for layout in reference.LAYOUTS:
        shards = recipe.shift_then_shard(toks, n, layout, ignore_first=PERIOD - 1)
        local = recipe.side_by_side([recipe.Shard(s.x, s.y, np.arange(S // n)) for s in shards])
        n_labels = int((local.y != layers.IGNORE).sum())
        wrong = transformer.forward(p, CONFIG, local.x, local.y, local.pos, VirtualRing(n, layout),
                                    n_labels)[0]
        assert abs(wrong - want) > 1e-3, f"{layout}: local positions should change the loss"


def test_loss_curves_agree_across_devices_and_layouts():
    steps = 3
    runs = {"dense": train.dense(CONFIG, ignore_first=PERIOD - 1)}
    runs |= {f"{layout} N={n}": train.virtual(CONFIG, n, layout, tile_size=TILE, ignore_first=PERIOD - 1)
             for n in (2, 4) for layout in reference.LAYOUTS}
    curves = {name: train.train(r, params(std=0.02), steps=steps, batch=B, seq_len=S, period=PERIOD)[0]
              for name, r in runs.items()}
    assert curves["dense"][-1] < curves["dense"][0], "three Adam steps should lower the loss"
    for name, curve in curves.items():
        assert_close(curve, curves["dense"], np.float64, what=name)


@pytest.mark.parametrize("layout", reference.LAYOUTS)
def test_next_tokens_are_the_argmax_of_the_logits(layout):
    """The model's guesses: the logits' argmax at every token, the same on the ring as dense."""
    p, toks, n = params(), tokens(), 4
    whole = recipe.shift_then_shard(toks, 1, "contiguous")[0]
    _, (*_, (logits, *_)) = transformer.forward(p, CONFIG, whole.x, whole.y, whole.pos, Dense(), S)
    dense = transformer.next_tokens(p, CONFIG, whole.x, whole.pos, Dense())
    assert dense.shape == (B, S) and (dense == logits.argmax(axis=-1)).all()
    here = recipe.side_by_side(recipe.shift_then_shard(toks, n, layout))
    ring = transformer.next_tokens(p, CONFIG, here.x, here.pos, VirtualRing(n, layout, tile_size=TILE))
    assert (ring == dense[:, here.pos]).all()


def test_float32_stays_float32():
    p32 = transformer.init_params(CONFIG, SEED, np.float32)
    loss, grads = train.virtual(CONFIG, 2, "striped").loss_and_grads(p32, tokens())
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float32)}
    p64 = {k: v.astype(np.float64) for k, v in p32.items()}
    want, want_grads = train.dense(CONFIG).loss_and_grads(p64, tokens())
    assert_close(loss, want, np.float32, what="float32 loss")
    for name in want_grads:
        assert_close(grads[name], want_grads[name], np.float32, what=f"float32 d {name}")


@pytest.mark.parametrize("layout", reference.LAYOUTS)
def test_the_virtual_ring_runs_on_the_shards_as_the_model_holds_them(monkeypatch, layout):
    """VirtualRing takes the N shards side by side and returns them so, equal to
    dense attention in natural order, without dealing or gathering tokens itself
    (`reference.shard` / `unshard` refused inside the call)."""
    import reference.virtual
    n, rng = 2, np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 8, 2, 4)) for _ in range(4))      # side by side, (B, N c, H, D)

    def natural(x, axis=1):
        return reference.unshard(np.split(x, n, axis=axis), layout, axis=axis)

    def refuse(*args, **kwargs):
        raise AssertionError("the model's ring moved its tokens out of the layout's order")

    attn = VirtualRing(n, layout, tile_size=TILE)
    monkeypatch.setattr(reference.virtual, "shard_at", refuse)
    monkeypatch.setattr(reference.virtual, "unshard_at", refuse)
    out, lse = attn.forward(q, k, v)
    grads = attn.backward(q, k, v, out, lse, dout)
    monkeypatch.undo()
    want_out, want_lse = reference.attention(*map(natural, (q, k, v)))
    assert_close(natural(out), want_out, np.float64, what="out")
    assert_close(natural(lse, axis=2), want_lse, np.float64, what="lse")
    want = reference.attention_backward(*map(natural, (q, k, v, out)), natural(lse, axis=2), natural(dout))
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_close(natural(got), w, np.float64, what=name)
    assert attn.seconds > 0


# -- on real MPI ranks ----------------------------------------------------------------------

MPIEXEC = find_mpiexec()
LAUNCH_TIMEOUT_S = 120


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
@pytest.mark.parametrize("n", RING_DEVICES)
def test_mpi_model_equals_dense(n, tmp_path):
    """Loss, every gradient and a 3-step loss curve on n real ranks, every layout in one launch."""
    pytest.importorskip("mpi4py")
    spec = dict(config=CONFIG.as_dict(), seed=SEED, std=STD, batch=B, seq_len=S, period=PERIOD,
                tile_size=TILE, steps=3)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", MPIEXEC_TIMEOUT=str(LAUNCH_TIMEOUT_S))
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py",
                           str(ROOT / "tests" / "support" / "mpi" / "model_worker.py"),
                           str(tmp_path / "spec.json"), str(tmp_path / "out.npz")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S + 30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = np.load(tmp_path / "out.npz")
    toks = tokens()
    want = dense_loss_and_grads(params(), toks)
    curve = train.train(train.dense(CONFIG, ignore_first=PERIOD - 1), params(std=0.02), steps=3,
                        batch=B, seq_len=S, period=PERIOD, seed=SEED)[0]
    for layout in reference.LAYOUTS:
        grads = {k.split("/", 2)[2]: got[k] for k in got.files if k.startswith(f"{layout}/grad/")}
        assert_same_loss_and_grads((float(got[f"{layout}/loss"]), grads), want, f"MPI N={n} {layout}")
        assert_close(got[f"{layout}/curve"], curve, np.float64, what=f"curve MPI N={n} {layout}")


# -- the speed-up formulas and the benchmark ---------------------------------------------------

def test_tms_pair_counted_is_the_papers():
    from reference.tms import theoretical_max_speedup
    for model, n, n_seq, hw in (("1B", 4, 16384, "a100"), ("7B", 8, 32768, "tpuv4"), ("3B", 2, 8192, "a100")):
        got = speedup.tms(speedup.paper_linear_flops_per_token(model), reference.cost.MODELS[model]["d_model"],
                          reference.cost.HARDWARE[hw], n_seq, n, "striped", mode="pairs")
        assert got == pytest.approx(theoretical_max_speedup(model, n, n_seq, hw), rel=1e-12)


def test_tms_tile_aware_at_the_papers_smallest_blocks():
    """A100 tiles of 2048 x 4096 and c = 4096: striped computes every tile, so no speed-up;
    with c = 8192 and N = 4, a causal block (striped's in every round, contiguous's in round 0)
    computes 6 of its 4 x 2 tiles and a full block 8, so the critical paths are 4 * 6 = 24
    and 6 + 3 * 8 = 30 tiles."""
    lin, d = speedup.paper_linear_flops_per_token("1B"), reference.cost.MODELS["1B"]["d_model"]
    assert speedup.tms(lin, d, 2, 16384, 4, tile_size=(2048, 4096), mode="tiles") == 1.0
    area = 2048 * 4096
    assert speedup.critical_work(32768, 4, "striped", (2048, 4096), "tiles") == 24 * area
    assert speedup.critical_work(32768, 4, "contiguous", (2048, 4096), "tiles") == 30 * area
    assert speedup.tms(0, d, 2, 32768, 4, tile_size=(2048, 4096), mode="tiles") == pytest.approx(30 / 24)


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")
def test_model_step_benchmark_smoke(tmp_path):
    """The benchmark end to end on tiny sequences: every layout timed, contiguous at 1.00,
    TMS tiles between 1 and TMS for striped, the paper's rows and the plot."""
    pytest.importorskip("matplotlib")
    from bench import model_step
    text, pngs = model_step.run(results_dir=tmp_path, seqs=(256,), paper_tables=("3",))
    rows = [line for line in text.splitlines() if line.startswith("| 256 |")]
    assert [r.split("|")[3].strip() for r in rows] == list(reference.LAYOUTS)
    assert rows[0].split("|")[8].strip() == "1.00"                      # contiguous's speed-up
    tms, tms_tiles = (float(rows[1].split("|")[i]) for i in (9, 10))    # striped
    assert 1 <= tms_tiles <= tms
    assert "Paper Table 3" in text and len(pngs) == 1 and pngs[0].stat().st_size > 1000


# -- the command line -------------------------------------------------------------------------

def test_command_line_trains_and_draws(tmp_path):
    pytest.importorskip("matplotlib")
    from model.__main__ import main
    main(["--backend", "virtual", "--n-devices", "2", "--layout", "all", "--steps", "3", "--seq-len", "16",
          "--batch", "2", "--period", "4", "--d-model", "16", "--heads", "2", "--d-ff", "32",
          "--plot", str(tmp_path / "curve.png"), "--out", str(tmp_path / "curve.npz")])
    assert (tmp_path / "curve.png").stat().st_size > 1000
    curves = np.load(tmp_path / "curve.npz")
    assert sorted(curves.files) == sorted(reference.LAYOUTS)
    assert all(len(curves[k]) == 3 for k in curves.files)


@pytest.mark.parametrize("argv, message", [
    (["--period", "300"], "--period (300) must be less than --seq-len (256)"),
    (["--steps", "0"], "argument --steps: expected an int of at least 1"),
    (["--seq-len", "254", "--n-devices", "4"], "sequence length 254 must be a positive multiple of n_devices = 4"),
])
def test_command_line_refuses_bad_options_before_training(argv, message, capsys):
    from model.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["--backend", "virtual", "--plot", "", "--out", ""] + argv)
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err + str(exit_.value.code)


# -- against computations that share no code with the model -----------------------------

def adam_by_hand(grads, lr, b1, b2, eps, warmup):
    """Kingma & Ba's Algorithm 1 on one scalar, in Python floats, with the linear warm-up."""
    theta, m, v, path = 0.0, 0.0, 0.0, []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        theta -= lr * min(1.0, t / warmup) * m_hat / (v_hat ** 0.5 + eps)
        path.append(theta)
    return path


def test_adam_is_kingma_and_ba_with_a_warm_up():
    # step 1 of Adam moves every parameter by lr (times the warm-up) against its
    # gradient's sign, whatever the gradient's size: the bias corrections exactly
    # undo the zero start (without them, (1 - b1) / sqrt(1 - b2) = 3.16 lr here)
    grads = [2.0, -0.5, 3.0, 1e-3, -4.0, 0.25]
    params = {"w": np.zeros(1), "x": np.zeros((2, 2))}
    opt = train.Adam(params, lr=0.1, betas=(0.9, 0.999), eps=1e-8, warmup=4)
    got = []
    for g in grads:
        opt.step(params, {"w": np.array([g]), "x": np.full((2, 2), -g)})
        got.append((params["w"][0], params["x"].copy()))
    assert abs(got[0][0] - (-0.1 * 1 / 4)) < 1e-9                   # lr * t / warmup * sign(g)
    want = adam_by_hand(grads, 0.1, 0.9, 0.999, 1e-8, 4)
    for t, ((w, x), expected) in enumerate(zip(got, want), start=1):
        assert abs(w - expected) < 1e-12, (t, w, expected)
        np.testing.assert_allclose(x, -expected, rtol=0, atol=1e-12)  # each element its own moments
    assert params["w"].dtype == np.float64
    small = {"w": np.zeros(1, np.float32)}
    train.Adam(small).step(small, {"w": np.ones(1)})                 # a float64 gradient
    assert small["w"].dtype == np.float32                          # updates keep the parameter's dtype


def softmax_attention(q, k, v, dout, scale):
    """Full (not causal) attention and its gradients, written out with einsum,
    one head per key/value head: out (B, S, H, D), and dq, dk, dv."""
    s = np.einsum("bihd,bjhd->bhij", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhij,bjhd->bihd", p, v)
    dp = np.einsum("bihd,bjhd->bhij", dout, v)
    ds = p * (dp - np.einsum("bihd,bihd->bhi", dout, out)[..., None])
    dq = np.einsum("bhij,bjhd->bihd", ds, k) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = np.einsum("bhij,bihd->bjhd", p, dout)
    return out, dq, dk, dv


@pytest.mark.parametrize("layout", reference.LAYOUTS)
def test_attention_backends_without_the_causal_mask_equal_softmax_written_out(layout, monkeypatch):
    """Dense, VirtualRing and MPIRing (on ranks as threads) with causal=False
    against plain softmax attention: every key visible, the causal flag reaching
    every call of each backend, forward and backward."""
    import threading

    from model.attention import MPIRing
    from reference.virtual import run_devices
    from test_gpu import ThreadComm, fake_world
    n, rng = 3, np.random.default_rng(8)
    q, k, v, dout = (rng.standard_normal((1, 12, 2, 4)) for _ in range(4))
    want = softmax_attention(q, k, v, dout, 0.5)

    def check(name, out, grads):
        for what, got, w in zip(("out", "dq", "dk", "dv"), (out,) + tuple(grads), want):
            assert_close(got, w, np.float64, f"{name} {what}")

    dense = Dense(causal=False)
    out, lse = dense.forward(q, k, v)
    check("Dense", out, dense.backward(q, k, v, out, lse, dout))
    ring = VirtualRing(n, layout, tile_size=2, causal=False)
    side = [np.concatenate(reference.shard(x, n, layout), axis=1) for x in (q, k, v, dout)]
    out, lse = ring.forward(*side[:3])
    grads = ring.backward(*side[:3], out, lse, side[3])
    natural = lambda x: reference.unshard(np.split(x, n, axis=1), layout)      # noqa: E731
    check("VirtualRing", natural(out), map(natural, grads))

    boxes, gathered, barrier = fake_world(n), [None] * n, threading.Barrier(n)

    def rank(j, _virtual):
        attn = MPIRing(ThreadComm(j, n, boxes, gathered, barrier), layout, tile_size=2, causal=False)
        mine = [reference.shard(x, n, layout)[j] for x in (q, k, v, dout)]
        o, l = attn.forward(*mine[:3])
        return (o,) + tuple(attn.backward(*mine[:3], o, l, mine[3]))
    results = run_devices(n, rank)
    gathered_out = [reference.unshard([r[i] for r in results], layout) for i in range(4)]
    check("MPIRing", gathered_out[0], gathered_out[1:])
