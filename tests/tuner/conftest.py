import json
import shutil

import pytest

FAKE = "tests.tuner.fake_engine:FakeEngine.from_gguf"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    from engine.gguf.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny", seed=0)


@pytest.fixture
def appliance(tmp_path, tiny_gguf):
    """Write a model folder and an appliance.toml for the fake engine; returns a writer that
    takes extra TOML (merged by section) and the fake engine's behaviour."""

    def write(sections=None, behaviour=None, drafts=("draft.gguf",), drafter="drafter.gguf"):
        models = tmp_path / "models"
        models.mkdir(exist_ok=True)
        shutil.copy(tiny_gguf, models / "target.gguf")
        for name in [*drafts, drafter] if drafter else drafts:
            (models / name).write_bytes(name.encode() * 100)
        (models / "target.gguf.fake.json").write_text(json.dumps(behaviour or {}))
        base = {
            "models": {"target": "models/target.gguf", "drafts": list(drafts),
                       "drafter": drafter or ""},
            "workload": {"code_prompts": 2, "long_form_prompts": 1, "niah_cases": 1,
                         "long_prompt_tokens": 64, "max_new_tokens": 4, "warmup": 0, "repeats": 2},
            "constraints": {"niah_min_accuracy": 0.0},
            "study": {"trials": 4, "trial_timeout_s": 20, "load_timeout_s": 60, "heartbeat_s": 1,
                      "remeasure_repeats": 2, "storage": "sqlite:///study.db"},
            "publish": {"profile": "out/profile.toml"},
        }
        base["models"]["drafts"] = [f"models/{d}" for d in drafts]
        base["models"]["drafter"] = f"models/{drafter}" if drafter else ""
        for section, values in (sections or {}).items():
            base.setdefault(section, {}).update(values)
        import tomli_w

        path = tmp_path / "appliance.toml"
        path.write_text(tomli_w.dumps(base))
        return path

    return write
