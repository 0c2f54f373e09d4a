"""Tiny random qwen35moe files shared by the PFlash tests: a target and a drafter with two
attention layers, both with the tiny preset's vocabulary."""

import pytest

from engine.gguf.make_model import make_model


@pytest.fixture(scope="session")
def pflash_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("pflash")
    target = make_model(d / "target.gguf", "tiny", seed=3)
    drafter = make_model(d / "drafter.gguf", "tiny", n_layers=8, seed=5)  # attention at layers 3 and 7
    return target, drafter
