"""bench/profile_decode.py: the repeating stretch of a captured step's timeline between launches of one kernel."""

import pytest


def _stretch(t0, gap, other_stream_dur):
    """One hot layer and one cold layer's launches from t0: the select launch, a copy on another stream beside a
    hot launch, the split, the collect."""
    return [
        {"name": "_select_kernel", "ts": t0, "dur": 8.0, "tid": 7},
        {"name": "_gather3_loop_kernel", "ts": t0 + 9.0, "dur": other_stream_dur, "tid": 20},
        {"name": "_gemv_kernel", "ts": t0 + 9.5, "dur": 30.0, "tid": 7},
        {"name": "_split_kernel", "ts": t0 + 40.0, "dur": 7.0, "tid": 7},
        {"name": "_collect_into_kernel", "ts": t0 + 48.0, "dur": gap, "tid": 7},
    ]


def test_cycle_anatomy_takes_medians_of_the_common_stretch(bench_script):
    pd = bench_script("profile_decode")
    kernels, t = [], 100.0
    for gap, side in ((40.0, 60.0), (50.0, 62.0), (45.0, 61.0), (44.0, 70.0)):
        kernels += _stretch(t, gap, side)
        t += 48.0 + gap + 3.0
    kernels.insert(7, {"name": "_other_kernel", "ts": kernels[6]["ts"] + 1.0, "dur": 1.0, "tid": 7})  # one odd stretch
    kernels.append({"name": "_select_kernel", "ts": t, "dur": 8.0, "tid": 7})
    cycle = pd.cycle_anatomy(kernels, "_select_kernel")
    head, rows = cycle[0], cycle[1:]
    assert head["repeats"] == 3 and head["of"] == 4  # the stretch with an extra launch left out
    assert [r["name"] for r in rows] == ["_select_kernel", "_gather3_loop_kernel", "_gemv_kernel", "_split_kernel",
                                         "_collect_into_kernel"]
    assert rows[0]["start_us"] == 0.0
    assert rows[1]["stream"] == 20 and rows[1]["end_us"] == pytest.approx(9.0 + 61.0)  # median of 60, 61, 70
    assert rows[4]["end_us"] == pytest.approx(48.0 + 44.0)  # median of 40, 45, 44
    assert head["length_us"] == pytest.approx(48.0 + 44.0 + 3.0)


def test_cycle_anatomy_needs_three_anchors(bench_script):
    pd = bench_script("profile_decode")
    kernels = _stretch(0.0, 10.0, 10.0) + _stretch(100.0, 10.0, 10.0)
    assert pd.cycle_anatomy(kernels, "_select_kernel") is None
    assert pd.cycle_anatomy(kernels, "_no_such_kernel") is None


def test_print_cycle_lists_the_launches(bench_script, capsys):
    pd = bench_script("profile_decode")
    kernels = [k for t in (0.0, 100.0, 200.0) for k in _stretch(t, 10.0, 10.0)]
    pd.print_cycle(pd.cycle_anatomy(kernels, "_select_kernel"), "_select_kernel")
    out = capsys.readouterr().out
    assert "100.0 us (median of 2 of 2 stretches alike)" in out
    assert "_split_kernel" in out and out.count("\n") >= 7
