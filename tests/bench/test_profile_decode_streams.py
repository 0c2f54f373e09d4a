"""bench/profile_decode.py's per-stream view of a captured step's kernels, on trace events made up here."""


def test_stream_summary_counts_each_stream_and_orders_its_kernels(bench_script):
    profile_decode = bench_script("profile_decode")
    kernels = [{"name": "_mixer", "tid": 7, "dur": 10.0}, {"name": "_gather3_kernel", "tid": 9, "dur": 30.0},
               {"name": "_mixer", "tid": 7, "dur": 12.5}, {"name": "_router", "tid": 9, "dur": 2.0},
               {"name": "_experts", "tid": 7, "dur": 5.0}]
    out = profile_decode.stream_summary(kernels)
    assert list(out) == [7, 9]  # the first kernel's stream first
    n, busy, top = out[7]
    assert (n, busy) == (3, 27.5) and top == [("_mixer", 22.5), ("_experts", 5.0)]
    n, busy, top = out[9]
    assert (n, busy) == (2, 32.0) and top[0] == ("_gather3_kernel", 30.0)
    assert profile_decode.stream_summary([]) == {}
