import dataclasses

import optuna
import pytest
from optuna.trial import TrialState

from storage.repository import Reader
from tuner.config import ConfigError, load_config
from engine.hardware import detect_hardware
from tuner.observer import RunObserver
from engine.profile import load_profile, model_hashes, verify_profile
from tuner.study import TrialDurations, Tuner
from tuner.telemetry import SW_THERMAL, TelemetrySampler

from .conftest import FAKE


def _trials(cfg):
    return optuna.load_study(study_name=cfg.study.name, storage=cfg.study.storage).get_trials()


def test_study_measures_checks_constraints_and_publishes(appliance):
    cfg = load_config(appliance(
        sections={"study": {"trials": 5}},
        behaviour={"incompatible": ["bad.gguf"], "lossy": ["lossy.gguf"]},
        drafts=("lossy.gguf", "draft.gguf", "bad.gguf")))
    result = Tuner(cfg, factory=FAKE).run()

    study = optuna.load_study(study_name=cfg.study.name, storage=cfg.study.storage)
    assert "hidden size 5120" in study.user_attrs["compatibility"]["draft:bad.gguf"]
    assert study.user_attrs["space"]["drafts"] == ["lossy.gguf", "draft.gguf"]
    trials = study.get_trials()
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    # The warm start: plain decoding, then the first compatible draft at a middle spec_len.
    assert trials[0].params == {"draft": "none", "pflash": "off"}
    assert trials[1].params == {"draft": "lossy.gguf", "spec_len": 5, "pflash": "off"}
    for t in trials:
        lossy = t.params["draft"] == "lossy.gguf"
        assert (t.constraints["greedy_mismatches"] > 0) == lossy
        assert t.constraints["ram_over_cap_mb"] < 0
    assert len(result.outcomes) == 5

    winner = result.winner
    assert winner is not None and winner.feasible and winner.params.draft != "lossy.gguf"
    profile = load_profile(result.profile)
    assert result.profile == cfg.publish.profile
    assert profile.trial == winner.number and profile.study == cfg.study.name
    assert profile.metrics["decode_tok_s"]["n"] == cfg.study.remeasure_repeats
    assert profile.metrics["decode_tok_s"]["low"] <= profile.metrics["decode_tok_s"]["median"]
    here = detect_hardware(None, "cpu", torch_cuda=False).fingerprint.as_dict()
    assert verify_profile(profile, here, model_hashes(profile)) == []

    reader = Reader.open(cfg.study.storage)
    rows = reader.measurements(cfg.study.name)
    assert sorted({m.trial_number for m in rows if m.phase == "trial"}) == [0, 1, 2, 3, 4]
    assert any(m.phase == "remeasure" and m.trial_number == winner.number for m in rows)
    assert all(reader.samples(m.id) for m in rows)
    assert [p.trial_number for p in reader.profiles(cfg.study.name)] == [winner.number]


def test_the_lookup_is_searched_with_the_draft_and_published(appliance):
    """With lookup match lengths configured, the warm start tries the draft without and with the longest;
    the fake engine decodes faster with the lookup, so the published profile carries it beside spec_len."""
    cfg = load_config(appliance(sections={"search": {"spec_lookup": [0, 3]}, "study": {"trials": 3}},
                                behaviour={"ms_per_token": 40.0}, drafts=("draft.gguf",), drafter=None))
    result = Tuner(cfg, factory=FAKE).run()
    trials = _trials(cfg)
    assert [t.params for t in trials] == [{"draft": "none"}, {"draft": "draft.gguf", "spec_len": 5, "spec_lookup": 0},
                                          {"draft": "draft.gguf", "spec_len": 5, "spec_lookup": 3}]
    assert [t.user_attrs.get("lookup") for t in trials] == [None, 0, 3]  # what the engine was asked for
    assert result.winner.params.spec_lookup == 3
    profile = load_profile(result.profile)
    assert profile.generate_options() == {"spec_len": 5, "spec_lookup": 3} and "draft" in profile.models
    rows = Reader.open(cfg.study.storage).measurements(cfg.study.name)
    assert {m.params.get("spec_lookup") for m in rows if m.trial_number == 2} == {3}


def test_a_draft_that_differs_only_at_a_tie_of_plain_decoding_stays_feasible(appliance):
    cfg = load_config(appliance(
        sections={"study": {"trials": 2}},
        behaviour={"tied": ["tied.gguf"], "last_margin_ulps": 0.0}, drafts=("tied.gguf",)))
    Tuner(cfg, factory=FAKE).run()
    study = optuna.load_study(study_name=cfg.study.name, storage=cfg.study.storage)
    assert all(m[-1] == 0.0 and m[0] == 100.0 for m in study.user_attrs["baseline_margins"].values())
    spec = [t for t in study.get_trials() if t.params.get("draft") == "tied.gguf"]
    assert spec and all(t.user_attrs["greedy_ties"] == 2 for t in spec)  # both code prompts
    rows = [r for r in Reader.open(cfg.study.storage).measurements(cfg.study.name)
            if r.params.get("draft") == "tied.gguf"]
    assert rows and all(r.status == "complete" and r.metrics["greedy_mismatches"] == 0
                        and r.metrics["greedy_ties"] == 2 for r in rows)


def test_a_hanging_trial_is_killed_and_the_study_goes_on(appliance):
    cfg = load_config(appliance(sections={"study": {"trials": 3, "trial_timeout_s": 3}},
                                drafts=("draft.gguf",), drafter=None))
    result = Tuner(cfg, factory=FAKE, hang={1: 600}).run()
    trials = _trials(cfg)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[1].user_attrs["failure"] == "timeout: no answer within 3 s: the worker was killed"
    assert [o.status for o in result.outcomes] == ["complete", "failed", "complete"]
    failed = [m for m in Reader.open(cfg.study.storage).measurements(cfg.study.name) if m.trial_number == 1]
    assert [m.status for m in failed] == ["failed"] and "timeout" in failed[0].reason
    assert result.profile is not None


def test_resuming_with_another_search_space_is_refused(appliance):
    path = appliance(sections={"study": {"trials": 1}}, drafts=(), drafter=None)
    Tuner(load_config(path), factory=FAKE).run()
    path = appliance(sections={"study": {"trials": 1}}, drafts=("draft.gguf",), drafter=None)
    with pytest.raises(ConfigError, match="differs from the one study 'luce-tune' was created with"):
        Tuner(load_config(path), factory=FAKE).run()


class _Warnings(RunObserver):
    def __init__(self):
        self.messages = []

    def warn(self, message):
        self.messages.append(message)


def test_a_missing_target_is_an_error_a_missing_drafter_a_warning(appliance, tmp_path):
    cfg = load_config(appliance(sections={"study": {"trials": 1}}, drafts=()))
    (tmp_path / "models" / "drafter.gguf").unlink()
    seen = _Warnings()
    result = Tuner(cfg, factory=FAKE, observer=seen).run()
    assert any(m.startswith("drafter.gguf is not used: model file") for m in seen.messages)
    (trial,) = _trials(cfg)
    assert trial.params == {} and result.profile is not None  # nothing left to search
    (tmp_path / "models" / "target.gguf").unlink()
    with pytest.raises(ConfigError, match=r"models\.target: model file .*target.gguf does not exist"):
        Tuner(cfg, factory=FAKE).run()


class _ThermalOnce(TelemetrySampler):
    """Host telemetry plus a GPU that reports thermal slowdown during the first measurement."""

    calls = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        type(self).calls += 1
        self.hot = type(self).calls == 1

    def read(self):
        sample = super().read()
        return dataclasses.replace(sample, gpu_clock_reasons=SW_THERMAL if self.hot else 0)


@pytest.mark.parametrize("retries, attempts, flagged", [(1, 2, False), (0, 1, True)])
def test_throttled_measurements_are_repeated_then_flagged(appliance, monkeypatch, retries, attempts, flagged):
    monkeypatch.setattr("tuner.study.TelemetrySampler", type("T", (_ThermalOnce,), {"calls": 0}))
    cfg = load_config(appliance(sections={"study": {"trials": 1, "throttle_retries": retries}},
                                drafts=(), drafter=None))
    Tuner(cfg, factory=FAKE).run()
    rows = [m for m in Reader.open(cfg.study.storage).measurements(cfg.study.name) if m.phase == "trial"]
    assert [m.attempt for m in rows] == list(range(attempts))
    assert rows[0].throttled and rows[0].telemetry["throttle_reasons"] == SW_THERMAL
    assert rows[-1].throttled == flagged
    (trial,) = _trials(cfg)
    assert trial.user_attrs.get("throttled", False) == flagged


def test_the_time_limit_is_judged_by_warm_trials_once_there_is_one():
    d = TrialDurations()
    d.add(140.0, cold=True)  # process start, load and kernel compilation
    d.add(12.0, cold=False)
    d.add(9.0, cold=False)
    assert d.fits(48.0, finals=3) and not d.fits(47.0, finals=3)  # the slowest warm trial, 12 s
    d.add(150.0, cold=True)  # a worker restarted after a failure
    assert d.fits(48.0, finals=3)
    d.add(30.0, cold=False)
    assert not d.fits(48.0, finals=3) and d.fits(120.0, finals=3)


def test_a_cold_trial_bounds_the_next_trial_alone():
    d = TrialDurations()
    assert d.fits(1.0, finals=3)
    d.add(112.0, cold=True)  # the 35B shapes' first trial: graph capture and compilation
    assert d.fits(185.0, finals=3)  # one more trial fits; its warm time then judges the rest
    assert not d.fits(100.0, finals=3)
    d.add(20.0, cold=False)
    assert d.fits(80.0, finals=3) and not d.fits(79.0, finals=3)  # 20 s x (1 + 3 finals)
