"""Bad model files through the CLI: one clear line naming the problem, exit status 2, no
traceback, within a second."""

import time
from pathlib import Path

import numpy as np
import pytest

from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import TensorSpec, write_gguf
from tuner.cli import main


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cli") / "good.gguf", "tiny", seed=0)


def rewrite(src, dst, *, metadata=None, drop=(), reshape=None):
    with GGUFFile(src) as f:
        md = {**f.metadata, **(metadata or {})}
        specs = []
        for name, info in f.tensors.items():
            if name in drop:
                continue
            shape = info.shape
            if reshape and name == reshape:
                shape = (shape[0] + 1,) + tuple(shape[1:])
            specs.append(TensorSpec(name, shape, info.qtype,
                                    lambda shape=shape, qt=info.qtype: np.zeros(shape, np.float32)))
        write_gguf(dst, md, specs)
    return dst


def truncated(good, path):
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return path


def wrong_magic(good, path):
    path.write_bytes(b"GGML" + good.read_bytes()[4:])
    return path


CASES = {
    "truncated": (truncated, ["bad.gguf"]),
    "wrong magic": (wrong_magic, ["bad.gguf", "magic"]),
    "other architecture": (lambda g, p: rewrite(g, p, metadata={"general.architecture": "llama"}),
                           ["bad.gguf", "llama", "qwen35moe"]),
    "wrong shape": (lambda g, p: rewrite(g, p, reshape="blk.0.attn_qkv.weight"),
                    ["bad.gguf", "blk.0.attn_qkv.weight", "expected"]),
    "missing tensor": (lambda g, p: rewrite(g, p, drop={"blk.2.ssm_out.weight"}),
                       ["bad.gguf", "blk.2.ssm_out.weight"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_file_is_one_clear_error_with_exit_status_2(case, good, tmp_path, capsys):
    make, words = CASES[case]
    bad = make(good, tmp_path / "bad.gguf")
    main(["inspect", str(good)])  # imports warm, so the timing below is the error path
    capsys.readouterr()
    t0 = time.perf_counter()
    status = main(["generate", "--model", str(bad), "--prompt", "hi", "--device", "cpu"])
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    message = " ".join(err.split())
    assert message.startswith("error:")
    for word in words:
        assert word in message, (word, message)
    assert elapsed < 1.0, f"{case}: {elapsed:.2f} s"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x"], ["generate", "--bogus"], ["nonsense"],
                                  ["train", "--preset"], ["train-draft", "--steps", "many"]])
def test_usage_errors_exit_2_without_traceback(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Error:" in err and "Traceback" not in err


def test_train_module_usage_error_exits_2(capsys):
    from engine.train.cli import main as train_main

    assert train_main(["train", "--bogus"]) == 2
    assert "No such option" in capsys.readouterr().err


def test_negative_spec_fallback_is_one_clear_error(capsys):
    """``--spec-fallback -1`` with the shipped target and draft: one line naming the option, exit 2,
    before the model loads."""
    root = Path(__file__).resolve().parents[2] / "models"  # committed with the repository
    status = main(["generate", "--model", str(root / "luce-target.gguf"), "--draft", str(root / "luce-draft.gguf"),
                   "--prompt", "def f(x):", "-n", "4", "--device", "cpu", "--spec-fallback", "-1"])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error:") and "--spec-fallback must be >= 0 (0: no plain stretches) or auto, got '-1'" in err
    assert "loaded" not in err


@pytest.mark.parametrize("extra, message", [
    (["--spec-lookup", "3"], "--spec-lookup needs --draft"),
    (["--spec-lookup", "17", "--draft", "DRAFT"], "--spec-lookup must be 0 (off) .. 16, got 17"),
])
def test_spec_lookup_errors_are_one_clear_line(extra, message, capsys):
    root = Path(__file__).resolve().parents[2] / "models"
    extra = [str(root / "luce-draft.gguf") if x == "DRAFT" else x for x in extra]
    status = main(["generate", "--model", str(root / "luce-target.gguf"), "--prompt", "x", "-n", "2",
                   "--device", "cpu", *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error:") and message in err


def test_spec_lookup_generates_the_plain_text(capsys):
    """``--spec-lookup 2`` with the shipped target and draft: the same greedy text as without speculation."""
    import json

    root = Path(__file__).resolve().parents[2] / "models"
    base = ["generate", "--model", str(root / "luce-target.gguf"), "--prompt", "def f(x):\n    return x\n\ndef f(x):",
            "-n", "24", "--device", "cpu", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", str(root / "luce-draft.gguf"), "--spec-len", "4", "--spec-lookup", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"] and spec["timings"]["lookup"] == 2


def test_dflash_timings_name_the_speculative_loop(capsys):
    """The timings line says the decode ran through DFlash (not plain decoding's eager path) and with the lookup."""
    root = Path(__file__).resolve().parents[2] / "models"
    assert main(["generate", "--model", str(root / "luce-target.gguf"), "--prompt", "def f(x):", "-n", "8",
                 "--device", "cpu", "--draft", str(root / "luce-draft.gguf"), "--spec-len", "4",
                 "--spec-lookup", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "tok/s (dflash)" in err and "dflash spec_len 4, lookup 2 |" in err


@pytest.mark.parametrize("extra, message", [
    (["--placement-unit", "layer"], "--placement-unit needs --expert-budget"),
    (["--placement-unit", "block", "--expert-budget", "1"],
     "placement_unit must be one of expert, layer, alternate, got 'block'"),
])
def test_placement_unit_errors_are_one_clear_line(good, extra, message, capsys):
    status = main(["generate", "--model", str(good), "--prompt", "x", "-n", "2", "--device", "cpu", *extra])
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2 and "Traceback" not in err
    assert err.startswith("error:") and message in err


def test_placement_unit_layer_generates(good, capsys):
    status = main(["generate", "--model", str(good), "--prompt", "def f(x):", "-n", "4", "--device", "cpu",
                   "--expert-budget", "1000", "--placement-unit", "layer", "--json"])
    assert status == 0
    assert '"new_tokens": 4' in capsys.readouterr().out
