"""Every page, rendered by Streamlit's AppTest on the tuner-made database, shows the numbers
the database holds (read independently through storage and Optuna)."""

import re
import tomllib

import pytest

from tests.dashboard.apptest import PAGES, chart, make_app, metrics
from tests.dashboard.seed import HUNG_TRIAL


def flat(pairs):
    return [v for pair in sorted(pairs) for v in pair]


@pytest.mark.parametrize("study", ["cpu-real", "search"])
@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_without_an_error(study_db, monkeypatch, study, page):
    at = make_app(study_db.url, monkeypatch, study=study, page=page)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert at.title and at.title[0].value
    assert at.sidebar.selectbox[0].value == study


def test_overview_counts_best_trial_and_pareto_front(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, study="search")
    trials = truth.trials["search"]
    shown = metrics(at)
    failed = [t for t in trials if t.state.name == "FAIL"]
    assert shown["Trials"] == str(len(trials))
    assert shown["Complete"] == str(len(truth.feasible("search")))
    assert shown["Infeasible"] == str(sum(t.state.name == "COMPLETE" for t in trials)
                                      - len(truth.feasible("search")))
    assert shown["Failed"] == str(len(failed)) == "1"
    assert shown["Running"] == "0"
    best = truth.best("search")
    assert shown["Best decode tok/s"] == f"{best.values[0]:.1f}"
    assert shown["Pareto front"] == str(len(truth.fronts["search"]))
    (shown_best,) = [int(m.group(1)) for m in
                     (re.search(r"\*\*Best trial: (\d+)\*\*", md.value) for md in at.markdown) if m]
    assert trials[shown_best].values[0] == best.values[0] and shown_best in truth.fronts["search"]

    spec = chart(at, "pareto")
    front = next(d for d in spec["data"] if d["name"] == "Pareto front")
    want = sorted((trials[n].values[1] * 1e3, trials[n].values[0]) for n in truth.fronts["search"])
    assert flat(zip(front["x"], front["y"])) == pytest.approx(flat(want), rel=1e-9)
    points = [(x, y) for d in spec["data"] if d["name"] not in ("Pareto front", "infeasible")
              for x, y in zip(d["x"], d["y"])]
    measured = [t for t in trials if t.state.name == "COMPLETE"]
    assert flat(points) == pytest.approx(flat((t.values[1] * 1e3, t.values[0]) for t in measured))
    legend = {d["name"] for d in spec["data"]}
    assert {"draft-a.gguf, PFlash on", "infeasible"} <= legend


def test_overview_of_the_real_engine_study(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, study="cpu-real")
    shown = metrics(at)
    best = truth.best("cpu-real")
    assert shown["Trials"] == str(len(truth.trials["cpu-real"]))
    assert shown["Complete"] == str(len(truth.feasible("cpu-real")))
    assert shown["Best decode tok/s"] == f"{best.values[0]:.1f}"
    assert shown["Its TTFT"] == f"{best.values[1] * 1e3:.1f} ms"
    assert best.values[0] > 0


def test_trials_table_filters_and_sorts(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, study="search", page="trials.py")
    table = at.dataframe[0].value
    trials = truth.trials["search"]
    assert list(table["trial"]) == [t.number for t in trials]
    for t in trials:
        row = table[table["trial"] == t.number].iloc[0]
        if t.values is not None:
            assert row["decode_tok_s"] == pytest.approx(t.values[0])
        for key, value in t.params.items():
            assert row[key] == value
    infeasible = table[table["status"] == "infeasible"]
    assert list(infeasible["draft"]) == ["draft-b.gguf"] * len(infeasible)
    assert all(r.startswith("violates greedy_mismatches") for r in infeasible["reason"])

    at.multiselect(key="trial_status").set_value(["failed"]).run()
    failed = at.dataframe[0].value
    assert list(failed["trial"]) == [HUNG_TRIAL]
    assert "no answer within 5 s" in failed["reason"].iloc[0]
    assert any(f"trial {HUNG_TRIAL}" in m.value and "timeout" in m.value for m in at.markdown)

    at.multiselect(key="trial_status").set_value(["complete", "infeasible"])
    at.selectbox(key="trial_sort").set_value("decode_tok_s")
    at.toggle(key="trial_desc").set_value(True).run()
    ranked = at.dataframe[0].value
    assert ranked["decode_tok_s"].iloc[0] == pytest.approx(max(t.values[0] for t in trials if t.values))
    assert list(ranked["decode_tok_s"]) == sorted(ranked["decode_tok_s"], reverse=True)


def test_landscape_heatmap_and_parallel_coordinates(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, study="search", page="landscape.py")
    heat = chart(at, "landscape_heatmap")["data"][0]
    measured = [t for t in truth.trials["search"] if t.values is not None]
    cells = [v for row in heat["z"] for v in row if v == v]  # NaN: a cell no trial measured
    assert max(cells) == pytest.approx(max(t.values[0] for t in measured))
    plain = [t.values[0] for t in measured if t.params["draft"] == "none" and t.params["pflash"] == "off"]
    column = heat["x"].index("0")  # spec_len 0: plain decoding
    assert heat["z"][heat["y"].index("1")][column] == pytest.approx(max(plain))
    dims = [d["label"] for d in chart(at, "landscape_parallel")["data"][0]["dimensions"]]
    assert dims == ["spec_len", "pflash_keep_ratio", "decode_tok_s"]

    # the shipped family on the CPU: only PFlash's keep ratio is numeric
    real = make_app(study_db.url, monkeypatch, study="cpu-real", page="landscape.py")
    ratios = [t.params["pflash_keep_ratio"] for t in truth.trials["cpu-real"]
              if t.values is not None and "pflash_keep_ratio" in t.params]
    if ratios:  # one numeric knob: a scatter of the objective against it (keep ratio 1.0 = off)
        xs = [x for trace in chart(real, "landscape_scatter")["data"] for x in trace["x"]]
        for r in ratios:
            assert any(x == pytest.approx(r) for x in xs), (r, xs)
    else:
        assert "searched no numeric knob" in real.info[0].value


def test_importance_ranks_parameters_or_says_why_not(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, study="search", page="importance.py")
    for key in ("importance_0", "importance_1"):
        bars = chart(at, key)["data"][0]
        assert set(bars["y"]) <= {"draft", "spec_len", "pflash", "pflash_keep_ratio"}
        assert sum(bars["x"]) == pytest.approx(1.0)
    # The real-engine study on a CPU has too few trials for importance.
    done = sum(t.state.name == "COMPLETE" for t in truth.trials["cpu-real"])
    assert done < 4
    few = make_app(study_db.url, monkeypatch, study="cpu-real", page="importance.py")
    assert [i.value for i in few.info] == [
        f"Parameter importance needs at least 4 completed trials; this study has {done} so far."] * 2


def test_telemetry_timelines_of_a_real_measurement(study_db, truth, monkeypatch):
    latest = max(m.trial_number for m in truth.reader.measurements("cpu-real"))
    measurements = truth.reader.measurements("cpu-real", latest)
    samples = truth.reader.samples(measurements[0].id)
    at = make_app(study_db.url, monkeypatch, study="cpu-real", page="telemetry.py")
    assert at.selectbox(key="telemetry_trial").value == latest
    shown = metrics(at)
    assert shown["Decode tok/s"] == f"{measurements[0].decode_tok_s:.1f}"
    assert shown["Throttled"] == "no"
    assert any(c.value.startswith(f"{len(samples)} samples") for c in at.caption)
    assert any("No GPU readings" in c.value for c in at.caption)
    lines = chart(at, "telemetry_timelines")["data"]
    assert [d["name"] for d in lines] == ["CPU (%)", "worker RSS (MB)", "RAM available (MB)"]
    assert lines[1]["y"] == pytest.approx([s.rss_mb for s in samples])

    # the published winner was measured again before publishing: both measurements are shown
    remeasure = next(m for m in truth.reader.measurements("cpu-real") if m.phase == "remeasure")
    at.selectbox(key="telemetry_trial").set_value(remeasure.trial_number).run()
    labels = at.selectbox(key="telemetry_measurement").options
    assert labels == ["trial attempt 0: complete", "remeasure attempt 0: complete"]
    at.selectbox(key="telemetry_measurement").set_value(1).run()
    assert metrics(at)["Decode tok/s"] == f"{remeasure.decode_tok_s:.1f}"


def test_profile_provenance_and_comparison(study_db, truth, monkeypatch):
    written = tomllib.loads((study_db.root / "cpu-real.toml").read_text())
    at = make_app(study_db.url, monkeypatch, study="cpu-real", page="profiles.py")
    provenance = at.table[0].value["value"]
    assert provenance["trial"] == str(written["profile"]["trial"])
    assert provenance["written to"] == str(study_db.root / "cpu-real.toml")
    assert provenance["file now"] == "matches what was published"
    assert provenance["model target"].startswith(written["models"]["target"]["path"])
    shown = metrics(at)
    assert shown["Published decode tok/s"] == f"{written['metrics']['decode_tok_s']['median']:.1f}"
    assert shown["Current best decode tok/s"] == f"{truth.best('cpu-real').values[0]:.1f}"
    assert "checksum" in at.code[0].value


def test_hardware_comparison_of_the_two_studies(study_db, truth, monkeypatch):
    at = make_app(study_db.url, monkeypatch, page="hardware.py")
    table = at.dataframe[0].value.set_index("study")
    (machine,) = truth.reader.hardware()
    assert set(table.index) == {"cpu-real", "search"}
    assert all(machine.cpu in label for label in table["machine"])
    for study in ("cpu-real", "search"):
        assert table.loc[study, "best decode tok/s"] == pytest.approx(truth.best(study).values[0])
        assert table.loc[study, "trials"] == len(truth.trials[study])
