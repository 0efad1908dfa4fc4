"""The paper's Theoretical Maximum Speedup (section 4), recomputed from FLOP counts.

Run: python3 -m pytest tests/oracle/test_tms.py -q
"""
from collections import Counter

import pytest

from reference.tms import PAPER_CSV, paper_rows, theoretical_max_speedup

PRINTED = 0.01        # the brief: within one unit of the paper's last printed digit
ROUNDING = 0.005      # half a unit: the recomputed value rounds to the printed one

ROWS = paper_rows()
ROWS_PER_TABLE = {"3": 21, "4": 20, "5": 12, "A.1": 80, "A.2": 16, "A.3": 41}


def _id(r):
    return f"{r['table']}-{r['hardware']}-{r['model']}-{r['model_parallel']}x{r['seq_parallel']}-{r['n_seq']}"


def test_csv_has_every_row():
    assert PAPER_CSV.read_text().startswith("# typed from")
    assert Counter(r["table"] for r in ROWS) == ROWS_PER_TABLE


@pytest.mark.parametrize("table, same_as", [
    ("3", lambda r: r["table"] == "A.1" and r["model_parallel"] == 2 and r["seq_parallel"] == 4),
    ("4", lambda r: r["table"] == "A.3" and r["seq_parallel"] == 8),
    ("5", lambda r: r["table"] == "A.1" and r["model_parallel"] == 1 and r["n_seq"] <= 24576 * r["seq_parallel"]),
])
def test_main_tables_repeat_the_appendix(table, same_as):
    # Tables 3, 4, 5 are excerpts of Appendix A: a typo in either shows up here.
    key = lambda r: (r["model"], r["model_parallel"], r["seq_parallel"], r["n_seq"], r["tms"], r["speedup"])
    assert sorted(map(key, (r for r in ROWS if r["table"] == table))) == sorted(map(key, filter(same_as, ROWS)))


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_recomputed_tms_matches_paper(row):
    assert abs(row["tms_recomputed"] - row["tms"]) <= PRINTED


def test_largest_residual_is_within_rounding():
    worst = max(ROWS, key=lambda r: abs(r["tms_recomputed"] - r["tms"]))
    assert abs(worst["tms_recomputed"] - worst["tms"]) < ROUNDING, _id(worst)


@pytest.mark.parametrize("model", ["1B", "3B", "7B"])
@pytest.mark.parametrize("hardware", ["a100", "tpuv4"])
def test_independent_of_model_parallelism(model, hardware):
    one = theoretical_max_speedup(model, 4, 65536, hardware)
    for mp in (2, 4, 8):
        assert theoretical_max_speedup(model, 4, 65536, hardware, model_parallel=mp) == pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("hardware", ["a100", "tpuv3"])
def test_tends_to_two(hardware):
    # One device has nothing to balance; more devices or tokens only help; the limit is
    # 2 - 1/N (section 2.2), and 2 as N grows too.
    assert theoretical_max_speedup("7B", 1, 65536, hardware) == pytest.approx(1.0)
    by_n_seq = [theoretical_max_speedup("7B", 8, 8 * 2**k, hardware) for k in range(10, 30)]
    by_devices = [theoretical_max_speedup("7B", n, n * 2**16, hardware) for n in (2, 4, 8, 16, 64, 256)]
    assert by_n_seq == sorted(by_n_seq) and by_devices == sorted(by_devices)
    assert all(1 < t < 2 for t in by_n_seq + by_devices)
    assert by_n_seq[-1] == pytest.approx(2 - 1 / 8, abs=1e-3)
    assert theoretical_max_speedup("7B", 1024, 1024 * 2**30, hardware) == pytest.approx(2, abs=2e-3)


@pytest.mark.parametrize("kwargs", [
    dict(model="13B"), dict(hardware="h100"), dict(seq_parallel=0),
    dict(model_parallel=0), dict(n_seq=16385),
])
def test_bad_input_raises(kwargs):
    args = dict(model="1B", seq_parallel=4, n_seq=16384, hardware="a100") | kwargs
    with pytest.raises(ValueError):
        theoretical_max_speedup(**args)
