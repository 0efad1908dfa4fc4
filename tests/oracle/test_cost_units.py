"""The cost model's time and units, and the choice line of `python -m mpi_impl`:
what a user reads off `python -m reference.cost --scheme` and under the MPI
table, held to numbers worked out by hand.

- a transfer that no compute overlaps (the all-gather's, the all-to-all's) is
  paid once, on top of the round's compute, even where it outlasts compute;
- every bandwidth is GB/s (10^9 bytes a second) and every memory GiB (2^30
  bytes), as the help says: a known value fed through each option is read back
  where the cost model uses it;
- with --no-causal the predicted speed-up and the choice are a full
  attention's: no layout helps, and every scheme computes S x S pairs.

    .venv/bin/python -m pytest tests/oracle/test_cost_units.py -q
"""

import numpy as np
import pytest

from mpi_impl import cli, scheme_args
from reference import cost, scheme_cost
from reference.schemes import Scheme

SHAPE = dict(B=1, Hq=4, Hkv=4, D=16, tile_size=16)


def block_bytes(tokens, Hkv=4, D=16, itemsize=4):
    """One K/V block on the wire (reference/scheme_cost.py's docstring): K and V, positions, owner."""
    return 2 * Hkv * tokens * D * itemsize + 8 * tokens + 8


# -- exposed transfers, paid once ---------------------------------------------------

def test_the_all_gather_pays_its_gather_once_whatever_the_link():
    """The all-gather moves one block in each of its N - 1 first rounds before
    any compute: its time is those transfers plus the compute of every round,
    once each, at a link slow enough that a transfer outlasts a round's compute."""
    n, S = 4, 256
    scheme = Scheme.checked("all_gather", None, n_devices=n, Hq=4, Hkv=4)
    fwd = scheme_cost.predict_scheme(scheme, S, "striped", **SHAPE)
    rate = 1e9
    compute = (fwd.work.tile_area * fwd.flops_per_entry).max(axis=1) / rate     # (rounds,)
    for link in (1e3, 1e6, 1e12):                     # transfers far longer than compute, and far shorter
        gather = (n - 1) * block_bytes(S // n) / link
        assert fwd.seconds(link, rate) == pytest.approx(gather + compute.sum(), rel=1e-12), link


def test_the_all_to_all_is_paid_once_beside_a_ring_that_overlaps():
    """USP: the ring's shifts overlap compute; the all-to-all before the first
    round and after the last do not. At a link so slow that compute is nothing,
    the time is every byte moved once: the ring's shifts and the two trades."""
    scheme = Scheme.checked("usp", 2, n_devices=4, Hq=4, Hkv=4)
    fwd = scheme_cost.predict_scheme(scheme, 256, "striped", **SHAPE)
    c, u, e = 64, 2, 4
    trade_in = (1 * c * 4 * 16 + 2 * c * 4 * 16) * e // 2           # (u - 1) / u of q, k, v
    trade_out = (c * 4 * 16 * e + 4 * c * 4) // 2                   # of out and lse (float32)
    ring = block_bytes(u * c, Hkv=2)                               # one block of u c tokens, Hkv / u heads
    link = 1.0
    want = ring + trade_in + trade_out                             # r = 2 ring ranks: one shift
    assert fwd.seconds(link, 1e30) == pytest.approx(want, rel=1e-12)


# -- units: GB/s and GiB, read back where they are used ------------------------------

@pytest.fixture
def chosen(monkeypatch):
    """What `choose` was given: [(link bytes/s, flops/s, memory bytes)], the real choice still made."""
    calls, real = [], scheme_cost.choose

    def spy(costs, link, rate, memory=None):
        calls.append((link, rate, memory))
        return real(costs, link, rate, memory)
    monkeypatch.setattr(cost, "choose", spy)
    monkeypatch.setattr(scheme_args, "choose", spy)
    return calls


def test_reference_cost_takes_gb_per_s_tflops_and_gib(chosen, capsys):
    cost.main(["--scheme", "ring", "--n-devices", "4", "--seq-len", "1024", "--heads", "4", "--kv-heads", "4",
               "--head-dim", "16", "--link-gbs", "2.5", "--tflops", "0.001", "--memory-gib", "1.5"])
    [(machine, rate, memory)] = chosen
    assert machine.inter.bytes_per_s == 2.5 * 10 ** 9 and machine.ranks_per_node == 1      # every byte over it
    assert (rate, memory) == (0.001 * 10 ** 12, 1.5 * 2 ** 30)
    out = capsys.readouterr().out
    assert "0.001 TFLOP/s per device; one link of 2.5 GB/s" in out and "fit in 1.5 GiB" in out
    ring = Scheme.checked("ring", None, n_devices=4, Hq=4, Hkv=4)
    shape = dict(B=1, Hq=4, Hkv=4, D=16, dtype="float16")
    fwd, bwd = (scheme_cost.predict_scheme(ring, 1024, "striped", backward=b, **shape) for b in (False, True))
    row = next(line.split() for line in out.splitlines() if line.startswith("ring"))
    assert float(row[-2]) == pytest.approx(fwd.seconds(2.5e9, 1e9) * 1e3, abs=1e-3)     # the fwd ms column
    assert float(row[-1]) == pytest.approx(bwd.seconds(2.5e9, 1e9) * 1e3, abs=1e-3)


def test_a_memory_limit_is_gib_not_gb(chosen, capsys):
    """A ring whose peak K/V is 1.03 GB fits in 1 GiB (2^30 bytes), not in 1 GB:
    it is chosen under --memory-gib 1."""
    S, D = 1_000_000, 128                       # c = 500,000 tokens a device, float32
    peak = 2 * (2 * (S // 2) * D * 4 + 8 * (S // 2) + 8)          # two blocks held in the first round
    assert 10 ** 9 < peak < 2 ** 30
    cost.main(["--scheme", "ring", "--n-devices", "2", "--seq-len", str(S), "--heads", "1", "--kv-heads", "1",
               "--head-dim", str(D), "--dtype", "float32", "--layout", "contiguous", "--tile-size", "100000",
               "--memory-gib", "1"])
    assert chosen[0][2] == 2 ** 30
    assert capsys.readouterr().out.splitlines()[-1].startswith("choice: ring")


def test_mpi_impl_takes_gb_per_s(chosen):
    """The choice line prices this machine as one node of the run's ranks, its
    shared memory at --link-gbs, and says so."""
    args = cli.build_parser().parse_args(["--seq-len", "256", "--heads", "4", "--head-dim", "16", "--link-gbs", "0.5"])
    line = scheme_args.choice_line(args, 4, "striped", cli.mask_options(args), 2e9)
    [(machine, rate, memory)] = chosen
    assert (machine.ranks_per_node, machine.intra.bytes_per_s, rate, memory) == (4, 0.5 * 10 ** 9, 2e9, None)
    assert "this machine: one node of 4 ranks, shared memory between processes at 0.5 GB/s, given by " \
           "--link-gbs; 2.0 GFLOP/s measured" in line


@pytest.mark.parametrize("option", ["--link-gbs", "--tflops", "--memory-gib"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_the_cost_model_refuses_rates_and_memory_that_are_not_positive(option, value, capsys):
    with pytest.raises(SystemExit) as stop:
        cost.main(["--scheme", "all", option, value])
    assert stop.value.code == 2 and f"argument {option}: expected a number above 0" in capsys.readouterr().err


def test_the_library_refuses_them_too():
    ring = Scheme.checked("ring", None, n_devices=2, Hq=4, Hkv=4)
    fwd = scheme_cost.predict_scheme(ring, 64, "striped", **SHAPE)
    for link, rate in ((0.0, 1e9), (1e9, -1.0), (np.nan, 1e9), (1e9, np.inf)):
        with pytest.raises(ValueError, match="must be a (finite )?number above 0"):
            fwd.seconds(link, rate)
    assert fwd.seconds(np.inf, 1e9) == fwd.work.tile_area.max(axis=1).sum() * fwd.flops_per_entry / 1e9   # compute alone
    with pytest.raises(ValueError, match=r"query heads Hq \(32\) must be a multiple of key/value heads Hkv \(5\)"):
        scheme_cost.predict_scheme(ring, 64, "striped", B=1, Hq=32, Hkv=5, D=16)
    with pytest.raises(ValueError, match="B must be a positive int, got 0"):
        scheme_cost.predict_scheme(ring, 64, "striped", B=0, Hq=4, Hkv=4, D=16)


# -- --no-causal --------------------------------------------------------------------

def test_without_the_causal_mask_no_layout_is_predicted_faster():
    """Every key visible: every device has a full block every round in every
    layout, so the predicted speed-up is 1 (a causal run's striped one is above)."""
    for causal, above_one in ((False, False), (True, True)):
        args = cli.build_parser().parse_args(["--seq-len", "256", "--heads", "4", "--head-dim", "16",
                                              "--tile-size", "16", "--causal" if causal else "--no-causal"])
        scheme = scheme_args.scheme_of(args, 4)
        predicted = scheme_args.predicted_speedup(args, scheme, "striped", cli.mask_options(args))
        assert (predicted > 1.05) == above_one and (causal or predicted == 1.0), (causal, predicted)


def test_without_the_causal_mask_the_choice_prices_full_attention(chosen):
    """Each scheme's time in the choice line is its full attention's: every
    device computes S x S / N pairs of each head, 4 D flops each, forward."""
    args = cli.build_parser().parse_args(["--seq-len", "256", "--heads", "4", "--head-dim", "16", "--tile-size", "16",
                                          "--no-causal", "--link-gbs", "1000"])
    line = scheme_args.choice_line(args, 4, "striped", cli.mask_options(args), 1e9)
    full = 4 * 16 * 4 * 256 * 256 / 4 / 1e9                        # seconds of one device's forward at 1 GFLOP/s
    ring_ms = float(line.split("[ring ")[1].split(" ms")[0])
    assert ring_ms == pytest.approx(full * 1e3, abs=0.5), line      # causal: about half


def test_reference_cost_predicts_full_attention_with_no_causal(capsys):
    cost.main(["--seq-len", "1024", "--n-devices", "4", "--tile-size", "64", "--no-causal"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:5]]
    assert [row[0] for row in rows] == ["contiguous", "striped", "zigzag"]
    assert all(float(x) == 1.0 for row in rows for x in row[3:5])
    assert all(int(row[2]) == 4 * 256 * 256 for row in rows)     # N rounds of a full block's pairs
