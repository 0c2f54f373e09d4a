"""The pages' tables, on trial views made by hand."""

from datetime import datetime

from dashboard.data import StudyView, TrialView
from dashboard.frames import landscape_frame, trials_frame
from storage.records import StudyRecord, TrialRecord


def _view(*params) -> StudyView:
    trials = tuple(
        TrialView(record=TrialRecord(study="s", number=i, state="COMPLETE", params=p, values=(10.0 + i, 0.1),
                                     constraints={}, user_attrs={}, started=datetime(2026, 1, 1), finished=None),
                  status="complete", reason="", metrics={"decode_tok_s": 10.0 + i, "ttft_s": 0.1}, on_front=True)
        for i, p in enumerate(params))
    study = StudyRecord(name="s", directions=("MAXIMIZE", "MINIMIZE"), objective_names=("decode_tok_s", "ttft_s"),
                        n_trials=len(trials), user_attrs={})
    return StudyView(study=study, trials=trials, measurements=())


def test_the_lookup_is_a_trial_column_and_a_landscape_knob():
    """spec_lookup sits beside spec_len in the trials table and the landscape, 0 where a trial has no draft."""
    view = _view({"draft": "none"}, {"draft": "d.gguf", "spec_len": 4, "spec_lookup": 0},
                 {"draft": "d.gguf", "spec_len": 4, "spec_lookup": 3})
    table = trials_frame(view)
    assert list(table["spec_lookup"].fillna(-1)) == [-1, 0, 3]
    frame, dims = landscape_frame(view)
    assert dims == ["spec_len", "spec_lookup"]
    assert list(frame["spec_lookup"]) == [0.0, 0.0, 3.0] and list(frame["spec_len"]) == [0.0, 4.0, 4.0]
    _, older = landscape_frame(_view({"draft": "none"}, {"draft": "d.gguf", "spec_len": 4}))
    assert older == ["spec_len"]  # a study without the lookup draws as before
