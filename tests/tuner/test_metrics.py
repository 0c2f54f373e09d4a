import pytest

from tuner.metrics import Stat, aggregate, constraints
from tuner.protocol import Output


def _out(key, repeat, new_tokens, decode_s, prefill_s, ids=(1, 2, 3), text="", **extra):
    timings = {"new_tokens": new_tokens, "decode_s": decode_s, "prefill_s": prefill_s,
               "decode_tok_s": (new_tokens - 1) / decode_s, "peak_mem_mb": 100.0 + repeat, **extra}
    return Output(key=key, repeat=repeat, ids=tuple(ids), text=text, timings=timings)


def test_stat_is_median_with_range():
    s = Stat.of([3.0, 1.0, 10.0])
    assert (s.median, s.low, s.high, s.n, s.spread) == (3.0, 1.0, 10.0, 3, 9.0)
    with pytest.raises(ValueError):
        Stat.of([])


def test_decode_rate_pools_tokens_and_time_per_repeat_then_takes_the_median():
    outputs = [
        _out("a", 0, 11, 1.0, 0.1), _out("b", 0, 21, 1.0, 0.3),   # 30 tokens / 2 s = 15
        _out("a", 1, 11, 0.5, 0.2), _out("b", 1, 21, 1.5, 0.2),   # 30 / 2 = 15
        _out("a", 2, 11, 2.0, 0.5), _out("b", 2, 21, 4.0, 0.5),   # 30 / 6 = 5
    ]
    m = aggregate(outputs)
    assert m.decode_tok_s.median == pytest.approx(15.0)
    assert m.decode_tok_s.low == pytest.approx(5.0)
    assert m.ttft_s.median == pytest.approx(0.2)  # per-repeat means 0.2, 0.2, 0.5
    assert m.peak_mem_mb == 102.0
    assert m.greedy_mismatches is None and m.niah_accuracy is None


def test_greedy_check_and_niah_score_and_extras():
    outputs = [_out("code-0", r, 5, 1.0, 0.1, ids=(1, 2, 3, 4, 5), acceptance_length=2.0 + r)
               for r in range(2)]
    outputs += [_out("code-1", 0, 5, 1.0, 0.1, ids=(9, 9, 9, 9, 9)),
                _out("code-1", 1, 5, 1.0, 0.1, ids=(1, 1, 1, 1, 1))]
    outputs += [_out("niah-0", r, 5, 1.0, 0.1, text="the key is 42" if r else "no idea") for r in range(2)]
    baseline = {"code-0": [1, 2, 3, 4, 5], "code-1": [1, 1, 1, 1, 1]}
    m = aggregate(outputs, baseline=baseline, score=lambda key, text: float("42" in text),
                  niah_keys=["niah-0"])
    assert m.greedy_mismatches == 1  # code-1 differed in one repeat
    assert m.niah_accuracy == pytest.approx(0.5)
    assert m.extras == {"acceptance_length": pytest.approx(2.5)}


def test_a_first_difference_at_a_numerical_tie_is_counted_apart():
    base = {"tie": [1, 2, 3, 4], "wide": [1, 2, 3, 4], "mixed": [1, 2, 3, 4]}
    margins = {"tie": [50.0, 0.0, 50.0, 50.0], "wide": [50.0, 50.0, 50.0, 50.0],
               "mixed": [50.0, 0.5, 50.0, 9.0]}
    outputs = [_out("tie", 0, 4, 1.0, 0.1, ids=(1, 7, 7, 7)),  # departs at a 0-ulp gap
               _out("wide", 0, 4, 1.0, 0.1, ids=(1, 2, 9, 9)),  # departs at a 50-ulp gap
               _out("mixed", 0, 4, 1.0, 0.1, ids=(1, 5, 3, 4)),  # a tie in one repeat...
               _out("mixed", 1, 4, 1.0, 0.1, ids=(1, 2, 3, 8))]  # ...a 9-ulp departure in the other
    m = aggregate(outputs, baseline=base, baseline_margins=margins, tie_ulps=1.0)
    assert (m.greedy_mismatches, m.greedy_ties) == (2, 1)
    m = aggregate(outputs, baseline=base, baseline_margins=margins, tie_ulps=10.0)
    assert (m.greedy_mismatches, m.greedy_ties) == (1, 2)
    m = aggregate(outputs, baseline=base, tie_ulps=1.0)  # no margins known: every difference counts
    assert (m.greedy_mismatches, m.greedy_ties) == (3, 0)
    short = [_out("tie", 0, 2, 1.0, 0.1, ids=(1, 2))]  # a prefix of the baseline differs at its end
    assert aggregate(short, baseline=base, baseline_margins=margins, tie_ulps=1.0).greedy_mismatches == 1


def test_constraints_are_feasible_at_or_below_zero():
    m = aggregate([_out("code-0", 0, 5, 1.0, 0.1)], baseline={"code-0": [7]})
    c = constraints(m, vram_cap_mb=1000.0, vram_peak_mb=1200.0, ram_cap_mb=500.0, rss_peak_mb=400.0,
                    uses_draft=True, greedy_identical=True, uses_pflash=False, niah_min_accuracy=0.9)
    assert c == {"vram_over_cap_mb": 200.0, "ram_over_cap_mb": -100.0, "greedy_mismatches": 1.0,
                 "niah_below_floor": 0.0}
    c = constraints(m, vram_cap_mb=None, vram_peak_mb=None, ram_cap_mb=500.0, rss_peak_mb=None,
                    uses_draft=False, greedy_identical=True, uses_pflash=True, niah_min_accuracy=0.9)
    assert "vram_over_cap_mb" not in c
    assert c["ram_over_cap_mb"] == pytest.approx(100.0 - 500.0)  # the engine's own peak as fallback
    assert c["greedy_mismatches"] == 0.0  # plain decoding is the baseline itself
    assert c["niah_below_floor"] == pytest.approx(0.9)  # PFlash on, nothing retrieved
