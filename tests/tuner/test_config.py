import textwrap
from pathlib import Path

import pytest

from tuner.config import ConfigError, default_config_path, load_config

MINIMAL = """
[models]
target = "m/target.gguf"
[study]
trials = 3
[publish]
profile = "out/profile.toml"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "appliance.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_embedded_default_loads_and_resolves_paths():
    cfg = load_config()
    root = default_config_path().parent
    assert cfg.source == default_config_path()
    assert cfg.models.target == root / "models/luce-target.gguf"
    assert cfg.models.drafts == (root / "models/luce-draft.gguf",)
    assert cfg.models.drafter == root / "models/luce-drafter.gguf"
    assert cfg.study.storage == f"sqlite:///{root / 'runs/luce-tune.db'}"
    assert cfg.hardware.vram_cap_mb is None and cfg.hardware.ram_cap_mb is None  # "live"
    assert cfg.objectives.directions == ("maximize", "minimize")
    assert cfg.study.trials is not None and cfg.study.timeout_s is not None
    assert cfg.search.spec_lookup == (0, 2, 3)


def test_minimal_config_takes_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL))
    assert cfg.models.target == tmp_path / "m/target.gguf"
    assert cfg.models.drafts == () and cfg.models.drafter is None
    assert cfg.publish.profile == tmp_path / "out/profile.toml"
    assert cfg.study.storage == f"sqlite:///{tmp_path / 'runs/luce-tune.db'}"
    assert cfg.search.spec_len == (2, 8)
    assert cfg.search.spec_lookup == (0,)  # the lookup off, not searched
    assert cfg.engine.load_options() == {}  # no [engine]: the engine's defaults


@pytest.mark.parametrize("extra, message", [
    ("[search]\nspec_len = [8, 2]\n", r"search\.spec_len: expected \[low, high\] with 1 <= low <= high, found \[8, 2\]"),
    ("[search]\nspec_len = 4\n", r"search\.spec_len: expected \[low, high\], two integers, found 4"),
    ("[search]\nspec_lookup = [0, 17]\n", r"search\.spec_lookup: expected distinct match lengths from 0 \(off\) to 16, found 17$"),
    ("[search]\nspec_lookup = [3, -1]\n", r"search\.spec_lookup: expected .* to 16, found -1$"),
    ("[search]\nspec_lookup = [2, 2]\n", r"search\.spec_lookup: expected distinct .*, found \[2, 2\]$"),
    ("[search]\nspec_lookup = []\n", r"search\.spec_lookup: expected distinct .*, found \[\]$"),
    ("[search]\nspec_lookup = 3\n", r"search\.spec_lookup: expected a list of integers, found 3$"),
    ("[search]\nspec_lookup = [0, 2.5]\n", r"search\.spec_lookup: expected a list of integers, found \[0, 2.5\]$"),
    ("[search]\npflash_keep_ratio = [0.0, 0.5]\n", r"search\.pflash_keep_ratio: .*0 < low"),
    ("[search]\ncold_cpu_share = [0.5, 1.2]\n", r"search\.cold_cpu_share: .*0 <= low <= high <= 1"),
    ("[search]\ncold_prefetch = [0, 5]\n", r"search\.cold_prefetch: .*0 <= low <= high <= 4, found \[0, 5\]"),
    ("[search]\ncold_warm = [0, 9]\n", r"search\.cold_warm: .*0 <= low <= high <= 8, found \[0, 9\]"),
    ("[search]\nplacement_unit = [\"expert\", \"block\"]\n", r"search\.placement_unit: .*among expert, layer"),
    ("[search]\nplacement_unit = []\n", r"search\.placement_unit: expected distinct names"),
    ("[search]\nplacement_unit = \"layer\"\n", r"search\.placement_unit: .*a list of names"),
    ("[hardware]\nvram_cap_mb = \"lots\"\n", r"hardware\.vram_cap_mb: expected \"live\" or a whole number of MB, found 'lots'"),
    ("[hardware]\ndevice = \"tpu\"\n", r"hardware\.device: expected one of auto, cpu, cuda, cuda:N, found 'tpu'"),
    ("[hardware]\nthreads = 0\n", r"hardware\.threads: expected at least 1"),
    ("[workload]\nrepeats = 0\n", r"workload\.repeats: expected at least 1, found 0"),
    ("[workload]\nmax_new_tokens = true\n", r"workload\.max_new_tokens: expected an integer, found True"),
    ("[objectives]\nmetrics = [\"speed\"]\n", r"objectives\.metrics: 'speed' is not one of decode_tok_s"),
    ("[constraints]\nniah_min_accuracy = 1.5\n", r"constraints\.niah_min_accuracy: expected a fraction in \[0, 1\], found 1.5"),
    ("[constraints]\ngreedy_tie_ulps = -1\n", r"constraints\.greedy_tie_ulps: expected 0 or more, found -1"),
    ("[search]\nbogus = 1\n", r"search\.bogus is not a known key; allowed: expert_budget_step_mb"),
    ("[extra]\n", r"unknown section \[extra\]"),
    ("[engine]\nexperts = \"int4\"\n", r"engine\.experts: expected one of dense, quantized, found 'int4'"),
    ("[engine]\ncuda_graph = \"yes\"\n", r"engine\.cuda_graph: expected true or false, found 'yes'"),
    ("[engine]\ncold_device = \"tpu\"\n", r"engine\.cold_device: expected one of cpu, gpu, found 'tpu'"),
])
def test_bad_values_name_file_key_value_and_what_is_allowed(tmp_path, extra, message):
    path = _write(tmp_path, MINIMAL + extra)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(info.value).startswith(str(path))
    assert "\n" not in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="appliance config not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(_write(tmp_path, "[models\n"))
    with pytest.raises(ConfigError, match=r"section \[models\] is missing"):
        load_config(_write(tmp_path, "[study]\ntrials = 1\n[publish]\nprofile = 'p'\n"))
    with pytest.raises(ConfigError, match=r"models\.target is missing"):
        load_config(_write(tmp_path, MINIMAL.replace('target = "m/target.gguf"', "")))
    with pytest.raises(ConfigError, match="study.trials: give a trial count, a timeout_s, or both"):
        load_config(_write(tmp_path, MINIMAL.replace("trials = 3", 'trials = "none"')))


def test_live_and_auto_words(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL + textwrap.dedent("""
        [hardware]
        vram_cap_mb = 8000
        ram_cap_mb = "live"
        threads = "auto"
        dtype = "bfloat16"
        device = "cuda:1"
        """)))
    assert cfg.hardware.vram_cap_mb == 8000 and cfg.hardware.ram_cap_mb is None
    assert cfg.hardware.threads is None and cfg.hardware.dtype == "bfloat16"
    assert cfg.hardware.gpu_index == 1


def test_command_line_overrides_are_validated(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL))
    assert cfg.with_study(trials=7).study.trials == 7
    with pytest.raises(ConfigError, match="command line: trials: expected at least 1, found 0"):
        cfg.with_study(trials=0)


def test_pflash_floor_needs_needle_cases(tmp_path):
    text = MINIMAL.replace('target = "m/target.gguf"', 'target = "t.gguf"\ndrafter = "d.gguf"')
    text += "[workload]\nniah_cases = 0\n[constraints]\nniah_min_accuracy = 0.5\n"
    with pytest.raises(ConfigError, match=r"constraints\.niah_min_accuracy 0.5 needs workload\.niah_cases"):
        load_config(_write(tmp_path, text))


def test_engine_section_becomes_load_options(tmp_path):
    cfg = load_config(_write(tmp_path, MINIMAL + "[engine]\nweights = \"quantized\"\nexperts = \"quantized\"\n"
                                               "cuda_graph = false\ncold_device = \"gpu\"\n"))
    assert cfg.engine.load_options() == {"weights": "quantized", "cold_format": "quantized",
                                         "hot_format": "quantized", "cuda_graph": False, "cold_device": "gpu"}
    assert load_config(_write(tmp_path, MINIMAL)).engine.load_options() == {}  # cuda_graph on: the engine's default


def test_engine_section_is_published_with_the_winner(tmp_path):
    from tuner.publish import build_profile
    from tuner.space import TrialParams

    cfg = load_config(_write(tmp_path, MINIMAL + "[engine]\nexperts = \"quantized\"\ncuda_graph = false\n"
                                               "cold_device = \"gpu\"\n"))
    fingerprint = {"gpu_name": "", "gpu_uuid": "", "gpu_driver": "", "gpu_vram_mb": 0, "cpu": "c", "cpu_count": 2,
                   "ram_mb": 1}
    files = {"target": {"path": str(cfg.models.target), "size": 1, "sha256": "0" * 64}}
    profile = build_profile(cfg, files, 3, TrialParams(expert_budget_mb=512), {}, "cuda", fingerprint)
    assert profile.load_options() == {"device": "cuda", "expert_budget_mb": 512, "cold_format": "quantized",
                                      "hot_format": "quantized", "cuda_graph": False, "cold_device": "gpu"}
