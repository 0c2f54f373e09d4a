"""``bench/restore.py``: the verify step and its restore timed per way on a tiny random target (CPU, eager): the
per-token states' buffer reported where they are kept, none where the replay is."""

import pytest

from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE


@pytest.mark.parametrize("way", ["states", "replay"])
def test_rows_name_the_way_and_time_both(bench_script, tmp_path, way):
    restore = bench_script("restore")
    with GGUFFile(make_model(tmp_path / "t.gguf", "tiny", seed=2)) as f:
        model = Qwen35MoE.from_gguf(f, device="cpu")
    row = restore.measure(model, 5, way, replays=3, repeats=2, prompt=8)
    assert row["restore"] == way and row["spec_len"] == 5 and row["path"] == "static"
    assert (row["states_mb"] > 0) == (way == "states")
    assert row["step_us"] > 0 and row["restore_us"] > 0
