"""Decode kernels compiled for Hopper on any machine: Triton's own compiler and ptxas (shipped in
its wheel) build them for sm_90 without a GPU, so a kernel that the interpreter runs but the
compiler rejects (a non-constexpr global, an unsupported construct) fails here, in CI, and the
machine code is checked for what the design relies on: each block's 16 code bytes loaded as one
16-byte vector, no register spills to local memory, no int-to-float conversion unit per code, and
with programmatic dependent launch, the GEMV's first weight tile loaded before its wait."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's NVIDIA backend tools are not installed")

# Run in a fresh interpreter: a test module of this session may have set TRITON_INTERPRET before the
# kernels were decorated, and interpreted kernels do not compile.
_COMPILE = """
import json, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
module, name, types, constexprs, warps, cubin, cuobjdump, ptx = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
if getattr(fn, "is_gluon", lambda: False)():
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
aligned = [i for i, (a, t) in enumerate(sig.items()) if t.startswith("*") or a.startswith("stride")]
src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                attrs={(i,): [["tt.divisibility", 16]] for i in aligned})  # as the launcher specializes them
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
open(cubin, "wb").write(kernel.asm["cubin"])
if ptx:
    print(kernel.asm["ptx"])
print(subprocess.run([cuobjdump, "--dump-sass", cubin], check=True, capture_output=True, text=True).stdout)
"""


def _sass(name: str, types: dict[str, str], constexprs: dict[str, int], warps: int, tmp_path: Path,
          module: str = "engine.kernels.quant.rows", ptx: bool = False) -> str:
    """The kernel's machine code (after its PTX with ``ptx``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    arg = json.dumps([module, name, types, constexprs, warps, str(tmp_path / "k.cubin"), str(CUOBJDUMP), ptx])
    done = subprocess.run([sys.executable, "-c", _COMPILE, arg], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _check(sass: str, least_vectors: int) -> None:
    ops = re.findall(r"\b(LDG\.E\.\w+|LDL|STL|I2F[.\w]*)\b", sass)
    assert ops.count("LDG.E.128") >= least_vectors, sorted(set(ops))
    assert "LDG.E.U8" not in ops and "LDL" not in ops and "STL" not in ops, sorted(set(ops))
    assert not [op for op in ops if op.startswith("I2F") and op != "I2F.RP"], sorted(set(ops))


@pytest.mark.parametrize("qtype", [0, 1], ids=["Q4_0", "Q8_0"])
def test_gemv_row_kernel_compiles_with_vector_loads(qtype, tmp_path):
    types = {"x_ptr": "*fp32", "w_ptr": "*u8", "out_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32"}
    consts = {"N_BLOCKS": 64, "SPLIT_BLOCKS": 32, "QTYPE": qtype, "SPLIT_AT": 64 * (16 if qtype == 0 else 32),
              "WARPS": 4, "UNROLL": 4, "SPLITS": 2}
    _check(_sass("_gemv_rows_kernel", types, consts, 4, tmp_path), 4 * (1 + qtype))


def test_expert_row_kernels_compile_with_vector_loads(tmp_path):
    types = {"x_ptr": "*fp32", "g_ptr": "*u8", "u_ptr": "*u8", "ids_ptr": "*i64", "act_ptr": "*fp32",
             "sgu_ptr": "*u8", "gi_ptr": "*fp32", "sgate_ptr": "*fp32"}
    consts = {"N_BLOCKS": 64, "QTYPE": 0, "SPLIT_AT": 1024, "WARPS": 8, "UNROLL": 4, "HAS_SHARED": True,
              "BLOCK_H": 2048}
    _check(_sass("_moe_gate_up_rows_kernel", types, consts, 8, tmp_path), 4)
    types = {"act_ptr": "*fp32", "d_ptr": "*u8", "ids_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*fp32",
             "sd_ptr": "*u8", "sgate_ptr": "*fp32"}
    consts = {"N_BLOCKS": 16, "TOP_K": 8, "QTYPE": 0, "SPLIT_AT": 256, "WARPS": 8, "UNROLL": 8, "HAS_SHARED": True,
              "SHARED_UNROLL": 2}
    _check(_sass("_moe_down_rows_kernel", types, consts, 8, tmp_path), 8)


def test_block_expert_kernel_compiles(tmp_path):
    """The block kernels' gate/up launch at the H200 table's tiles (the decode default there) builds for
    sm_90 too: 4 rows x 16 blocks over 128 threads load 8 code bytes a thread, without spills."""
    types = {"x_ptr": "*fp32", "g_ptr": "*u8", "u_ptr": "*u8", "ids_ptr": "*i64", "act_ptr": "*fp32",
             "sgu_ptr": "*u8", "gi_ptr": "*fp32", "sgate_ptr": "*fp32", "tg_ptr": "*u8", "tu_ptr": "*u8"}
    consts = {"K": 2048, "TOP_K": 8, "QTYPE": 0, "BLOCK_N": 4, "BLOCK_K": 512, "BLOCKWISE": True, "SPLIT_AT": 1024,
              "HAS_SHARED": True, "HAS_STAGE": False, "BLOCK_H": 2048, "WAIT_FIRST": True}
    sass = _sass("_moe_gate_up_kernel", types, consts, 4, tmp_path, module="engine.kernels.quant.triton")
    assert "LDG.E.64" in sass and "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_gemv_loads_its_first_weight_tile_before_waiting_on_the_kernel_before(pdl, tmp_path):
    """With programmatic dependent launch (``engine.kernels.pdl``) the GEMV lets the next kernel launch
    (PREEXIT), loads its first tile of code bytes and scales, and only then waits for the kernel before
    it (ACQBULK); x, written by that kernel and loaded under a mask, is read after the wait. Without it,
    neither instruction."""
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    consts = {"K": 2048, "K_SPLIT": 2048, "QTYPE": 0, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 1024,
              "BLOCKWISE": True, "SPLITS": 1, "SPLIT_AT": 1024, "PDL": pdl}
    sass = _sass("_gemv_kernel", types, consts, 4, tmp_path, module="engine.kernels.quant.triton").split("\n")
    at = {op: [i for i, line in enumerate(sass) if re.search(rf"\b{op}\b", line)] for op in ("PREEXIT", "ACQBULK")}
    if not pdl:
        assert at == {"PREEXIT": [], "ACQBULK": []}
        return
    (launch,), (wait,) = at["PREEXIT"], at["ACQBULK"]
    codes = [i for i, line in enumerate(sass) if re.search(r"\s LDG\.E\.128\b", line)]
    masked = [i for i, line in enumerate(sass) if re.search(r"@!?P\d+ +LDG\b", line)]
    assert launch < wait and sum(i < wait for i in codes) >= 2, sorted(set(at))
    assert masked and min(masked) > wait


DOWN_PAIRS_TYPES = {"act_ptr": "*bf16", "d_ptr": "*u8", "ids_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*bf16",
                    "sd_ptr": "*u8", "sgate_ptr": "*fp32", "td_ptr": "*u8", "part_ptr": "*fp32", "count_ptr": "*i32"}
DELTA_RULE_TYPES = {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32",
                    "s_ptr": "*fp32", "o_ptr": "*fp32", "s_out_ptr": "*fp32", "scale": "fp32", "gate_ptr": "*bf16",
                    "nw_ptr": "*fp32", "y_ptr": "*bf16", "count_ptr": "*i32", "eps": "fp32", "st_ptr": "*fp32"}
ROUTER_TYPES = {"x_ptr": "*bf16", "r_ptr": "*fp32", "l_ptr": "*fp32", "count_ptr": "*i32", "ids_ptr": "*i64",
                "w_ptr": "*fp32", "res_ptr": "*bf16", "nw_ptr": "*fp32", "h_out_ptr": "*bf16", "x_out_ptr": "*bf16",
                "eps": "fp32"}


@pytest.mark.parametrize("module, name, types, consts", [
    ("engine.kernels.rope_norm", "_norm_rope_cache_kernel",
     {"k_ptr": "*bf16", "v_ptr": "*bf16", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
      "slots_ptr": "*i64", "ck_ptr": "*bf16", "cv_ptr": "*bf16", "eps": "fp32"},
     {"D": 256, "HALF": 32, "BLOCK_D": 256, "PDL": True}),
    ("engine.kernels.decode_attention", "_combine_kernel",
     {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "slots_ptr": "*i64", "out_ptr": "*bf16",
      "g_ptr": "*bf16"},
     {"N_CHUNKS": 64, "GROUP": 8, "D": 256, "BLOCK_T": 1, "CHUNK": 256, "BLOCK_C": 16, "GATED": True, "PDL": True}),
    ("engine.kernels.moe_gate", "_route_kernel", ROUTER_TYPES,
     {"H": 2048, "K": 8, "BLOCK_E": 1, "BLOCK_H": 2048, "ALL_E": 256, "ADD_NORM": False, "PDL": True,
      "PREFETCH": False}),
    ("engine.kernels.moe_gate", "_route_kernel", ROUTER_TYPES,
     {"H": 2048, "K": 8, "BLOCK_E": 1, "BLOCK_H": 2048, "ALL_E": 256, "ADD_NORM": True, "PDL": True,
      "PREFETCH": False}),
    ("engine.kernels.quant.triton", "_moe_down_pairs_kernel", DOWN_PAIRS_TYPES,
     {"FFN": 512, "TOP_K": 8, "QTYPE": 0, "BLOCK_N": 4, "BLOCK_K": 512, "BLOCKWISE": True, "SPLIT_AT": 256,
      "HAS_SHARED": True, "HAS_STAGE": False, "PDL": True, "PREFETCH": False}),
    ("engine.kernels.quant.triton", "_moe_down_pairs_kernel", DOWN_PAIRS_TYPES,
     {"FFN": 512, "TOP_K": 8, "QTYPE": 0, "BLOCK_N": 4, "BLOCK_K": 512, "BLOCKWISE": True, "SPLIT_AT": 256,
      "HAS_SHARED": True, "HAS_STAGE": True, "PDL": True, "PREFETCH": True}),
    ("engine.kernels.gdn_decode", "_delta_rule_decode_kernel",
     {"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*fp32", "s_ptr": "*fp32",
      "o_ptr": "*fp32", "s_out_ptr": "*fp32", "scale": "fp32", "gate_ptr": "*bf16", "nw_ptr": "*fp32",
      "y_ptr": "*bf16", "count_ptr": "*i32", "eps": "fp32", "st_ptr": "*fp32"},
     {"T": 1, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "NORM": True, "BLOCK_DV": 128, "PDL": True,
      "PREFETCH": False, "STATES": False}),
    ("engine.kernels.gdn_decode", "_delta_rule_decode_kernel", DELTA_RULE_TYPES,
     {"T": 5, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "NORM": True, "BLOCK_DV": 128, "PDL": True,
      "PREFETCH": False, "STATES": True}),
], ids=["cache_write", "gated_combine", "router", "router_add_norm", "down_per_pair", "down_per_pair_staged",
        "delta_rule_gated_norm", "delta_rule_token_states"])
def test_attention_glue_kernels_compile(module, name, types, consts, tmp_path):
    """The attention layer's fused cache write and gated combine, the router (with the residual add +
    norm and without), the experts' down launch per pair and the delta rule with the gated norm (and a verify
    block's per-token states) build for sm_90 (the interpreter runs code the compiler may reject), without
    spills, waiting on the kernel before them."""
    sass = _sass(name, types, consts, 4, tmp_path, module=module)
    assert "ACQBULK" in sass and "LDL" not in sass and "STL" not in sass


@pytest.mark.parametrize("module, name, types, consts", [
    ("engine.kernels.rms_norm", "_add_rms_norm_kernel",
     {"h_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*fp32", "h_out_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
     {"BLOCK_D": 2048, "PDL": True}),
    ("engine.kernels.rms_norm", "_rms_norm_kernel",
     {"x_ptr": "*fp32", "w_ptr": "*fp32", "g_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
     {"HAS_GATE": True, "BLOCK_D": 128, "PDL": True}),
    ("engine.kernels.rope_norm", "_norm_rope_kernel",
     {"x_ptr": "*bf16", "w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16", "eps": "fp32"},
     {"D": 256, "HALF": 32, "BLOCK_D": 256, "PDL": True}),
    ("engine.kernels.moe_gate", "_route_kernel", ROUTER_TYPES,
     {"H": 2048, "K": 8, "BLOCK_E": 1, "BLOCK_H": 2048, "ALL_E": 256, "ADD_NORM": True, "PDL": True,
      "PREFETCH": True}),
], ids=["add_norm", "gated_norm", "norm_rope", "router_add_norm"])
def test_small_kernels_build_at_one_warp(module, name, types, consts, tmp_path):
    """The norms, the norm + RoPE and the router with the add + norm at the 35B rows with one warp a
    program (a setting of ``engine.kernels.warps`` that ``bench/small_kernels.py`` times): no spills,
    the PDL wait kept."""
    sass = _sass(name, types, consts, 1, tmp_path, module=module)
    assert "ACQBULK" in sass and "LDL" not in sass and "STL" not in sass


PREFILL_KERNELS = {  # name -> (pointer and int argument types, constexprs) at the 35B shapes, bf16 x
    "_gemm_kernel": ({"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16"},
                     {"K": 2048, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
    "_q_grouped_gate_up_kernel": ({"x_ptr": "*bf16", "g_ptr": "*u8", "u_ptr": "*u8", "act_ptr": "*bf16",
                                   "pairs_ptr": "*i64", "block_expert_ptr": "*i64"},
                                  {"H": 2048, "TOP_K": 8, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
    "_q_grouped_down_kernel": ({"act_ptr": "*bf16", "d_ptr": "*u8", "w_ptr": "*fp32", "out_ptr": "*fp32",
                                "pairs_ptr": "*i64", "block_expert_ptr": "*i64"},
                               {"FFN": 512, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
}


@pytest.mark.parametrize("qtype", [0, 1], ids=["Q4_0", "Q8_0"])
@pytest.mark.parametrize("name", sorted(PREFILL_KERNELS))
def test_prefill_kernels_compile_with_whole_block_tiles(name, qtype, tmp_path):
    """The prefill GEMM and grouped expert launches with whole-block tiles (``HALVES``) build for sm_90
    without spilling registers to local memory."""
    types, consts = PREFILL_KERNELS[name]
    k = consts.get("K", consts.get("H", consts.get("FFN")))
    consts = {**consts, "QTYPE": qtype, "DOT_PRECISION": "tf32", "HALVES": True,
              "SPLIT_AT": k // 32 * (16 if qtype == 0 else 32)}
    sass = _sass(name, types, consts, 4, tmp_path, module="engine.kernels.quant.triton")
    ops = re.findall(r"\b(LDL|STL)\b", sass)
    assert "HGMMA" in sass or "HMMA" in sass  # the tiles go to the tensor cores
    assert not ops, sorted(set(ops))


def _instructions(sass: str) -> list[str]:
    return re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
def test_word_gemv_compiles_to_fewer_instructions_than_the_block_gemv(pdl, tmp_path):
    """The word GEMV (``engine.kernels.quant.words``, Gluon) at the ``gdn_in`` program of the block GEMV's
    table (4 rows x 2,048, 2 warps): each block's codes one 16-byte load, no int-to-float conversion, no
    spills, no shared-memory staging of x, at most 70% of the block kernel's instructions (680 against
    1,048 when written); with PDL the first tile's words load before the wait."""
    types = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    tile = {"K": 2048, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_AT": 1024, "PDL": pdl}
    words = _sass("_gemv_words_kernel", types, {**tile, "WARPS": 2}, 2, tmp_path, module="engine.kernels.quant.words")
    blocks = _sass("_gemv_kernel", types, {**tile, "K_SPLIT": 2048, "QTYPE": 0, "BLOCK_M": 1, "BLOCKWISE": True,
                                           "SPLITS": 1}, 2, tmp_path, module="engine.kernels.quant.triton")
    ops = _instructions(words)
    assert ops.count("LDG.E.128") >= 4 and not [op for op in ops if op.startswith(("I2F", "LDL", "STL", "LDS."))]
    assert ops.count("LDS") <= 8  # shared memory only for the sum across warps
    assert len(ops) <= 0.7 * len(_instructions(blocks)), (len(ops), len(_instructions(blocks)))
    if pdl:
        lines = words.split("\n")
        wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
        assert sum(i < wait for i, line in enumerate(lines) if re.search(r"\sLDG\.E\.128\b", line)) == 4


@pytest.mark.parametrize("stage", [False, True], ids=["slots", "staged"])
def test_word_gate_up_compiles_as_two_word_gemvs(stage, tmp_path):
    """The experts' gate/up launch in the word layout at the 35B expert shapes (8 rows of gate and of up,
    K 2,048 in one tile, 2 warps, the shared expert riding along, PDL; with and without a stage stack):
    every block's codes one 16-byte load, no int-to-float conversion and no spills, the router's ids waited
    for before any weight is loaded, and at most 2.5 times the word GEMV's instructions for the same tile
    (two row sets, the routing and the shared gate: 2,896 against 1,248 when written)."""
    types = {"x_ptr": "*bf16", "g_ptr": "*u8", "u_ptr": "*u8", "ids_ptr": "*i32", "act_ptr": "*bf16",
             "sgu_ptr": "*u8", "gi_ptr": "*fp32", "sgate_ptr": "*fp32", "tg_ptr": "*u8", "tu_ptr": "*u8",
             "w_ptr": "*u8", "out_ptr": "*bf16"}
    tile = {"K": 2048, "BLOCK_N": 8, "BLOCK_K": 2048, "SPLIT_AT": 1024, "WARPS": 2, "PDL": True}
    sass = _sass("_moe_gate_up_words_kernel", types, {**tile, "TOP_K": 8, "HAS_SHARED": True, "HAS_STAGE": stage,
                                                      "BLOCK_H": 2048, "WAIT_FIRST": False}, 2,
                 tmp_path, module="engine.kernels.quant.words")
    gemv = _sass("_gemv_words_kernel", types, tile, 2, tmp_path, module="engine.kernels.quant.words")
    ops = _instructions(sass)
    assert ops.count("LDG.E.128") >= 16 and not [op for op in ops if op.startswith(("I2F", "LDL", "STL"))]
    assert len(ops) <= 2.5 * len(_instructions(gemv)), (len(ops), len(_instructions(gemv)))
    lines = sass.split("\n")
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    assert not [i for i, line in enumerate(lines) if i < wait and re.search(r"\sLDG\.E", line)]


def test_word_down_compiles_with_vector_loads(tmp_path):
    """The experts' down launch in the word layout at the 35B expert shapes (K 512: lane groups of 16 blocks,
    2 rows a lane, 8 pairs and the shared expert, PDL): every block's codes one 16-byte load (two rows of 9
    pairs: 18), no int-to-float conversion and no spills, and the router's ids waited for before any load."""
    types = {"act_ptr": "*bf16", "d_ptr": "*u8", "ids_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*bf16",
             "sd_ptr": "*u8", "sgate_ptr": "*fp32"}
    consts = {"FFN": 512, "TOP_K": 8, "ROWS": 2, "LANES_K": 16, "SPLIT_AT": 256, "HAS_SHARED": True, "WARPS": 1,
              "PDL": True}
    sass = _sass("_moe_down_words_kernel", types, consts, 1, tmp_path, module="engine.kernels.quant.words")
    ops = _instructions(sass)
    assert ops.count("LDG.E.128") == 18 and not [op for op in ops if op.startswith(("I2F", "LDL", "STL"))]
    lines = sass.split("\n")
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    assert not [i for i, line in enumerate(lines) if i < wait and re.search(r"\sLDG\.E", line)]


def _before_wait(sass: str, pattern: str) -> tuple[int, int]:
    """(loads matching ``pattern`` before the PDL wait, after it) in the machine code."""
    lines = sass.split("\n")
    wait = next(i for i, line in enumerate(lines) if "ACQBULK" in line)
    hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    return sum(i < wait for i in hits), sum(i > wait for i in hits)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "plain"])
@pytest.mark.parametrize("module, name, types, consts, least", [
    ("engine.kernels.moe_gate", "_route_kernel", ROUTER_TYPES,
     {"H": 2048, "K": 8, "BLOCK_E": 1, "BLOCK_H": 2048, "ALL_E": 256, "ADD_NORM": True, "PDL": True}, 2),
    ("engine.kernels.gdn_decode", "_delta_rule_decode_kernel", DELTA_RULE_TYPES,
     {"T": 1, "DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 32, "NORM": False, "BLOCK_DV": 128, "PDL": True,
      "STATES": False}, 4),
    ("engine.kernels.quant.triton", "_moe_down_pairs_kernel", DOWN_PAIRS_TYPES,
     {"FFN": 512, "TOP_K": 8, "QTYPE": 0, "BLOCK_N": 16, "BLOCK_K": 512, "BLOCKWISE": True, "SPLIT_AT": 256,
      "HAS_SHARED": True, "HAS_STAGE": True, "PDL": True}, 2),
], ids=["router", "delta_rule", "down_per_pair"])
def test_prefetching_kernels_load_before_their_wait(module, name, types, consts, least, prefetch, tmp_path):
    """With ``PREFETCH`` (``engine.kernels.pdl``) the router's weight rows, the delta rule's state and the
    down launch's code bytes are loaded before the PDL wait, and still some loads after it (the inputs the
    kernel before writes); without it nothing is loaded before the wait. At the 35B decode tiles, without
    spills."""
    sass = _sass(name, types, {**consts, "PREFETCH": prefetch}, 4, tmp_path, module=module)
    before, after = _before_wait(sass, r"\sLDG\.E")
    assert "LDL" not in sass and "STL" not in sass
    assert after >= 1
    assert before >= least if prefetch else before == 0, (before, after)


@pytest.mark.parametrize("wait_first", [True, False], ids=["wait_first", "launch_first"])
def test_word_gate_up_waits_before_the_down_launch_may_start(wait_first, tmp_path):
    """``WAIT_FIRST``: the gate/up launch's wait (ACQBULK) comes before it lets the next kernel launch
    (PREEXIT), so the down launch starts after the router has completed; otherwise the other way round."""
    types = {"x_ptr": "*bf16", "g_ptr": "*u8", "u_ptr": "*u8", "ids_ptr": "*i32", "act_ptr": "*bf16",
             "sgu_ptr": "*u8", "gi_ptr": "*fp32", "sgate_ptr": "*fp32", "tg_ptr": "*u8", "tu_ptr": "*u8"}
    consts = {"K": 2048, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_AT": 1024, "WARPS": 2, "PDL": True, "TOP_K": 8,
              "HAS_SHARED": True, "HAS_STAGE": False, "BLOCK_H": 2048, "WAIT_FIRST": wait_first}
    lines = _sass("_moe_gate_up_words_kernel", types, consts, 2, tmp_path, module="engine.kernels.quant.words")
    lines = lines.split("\n")
    (wait,) = [i for i, line in enumerate(lines) if "ACQBULK" in line]
    (launch,) = [i for i, line in enumerate(lines) if re.search(r"\bPREEXIT\b", line)]
    assert (wait < launch) == wait_first


@pytest.mark.parametrize("name, module, types, consts", [
    ("_collect_into_kernel", "engine.kernels.host_share_triton",
     {"reply_i": "*i32", "reply_f": "*fp32", "seq_ptr": "*i32", "pending_ptr": "*i32", "acc_ptr": "*fp32",
      "acc2_ptr": "*fp32", "dst_ptr": "*bf16"},
     {"N": 2048, "SPINS": 1 << 24, "REPLY_HEADER": 16, "BLOCK": 1024, "POOL": True, "TWO": True}),
    ("_collect_kernel", "engine.kernels.host_share_triton",
     {"reply_i": "*i32", "reply_f": "*fp32", "seq_ptr": "*i32", "out_ptr": "*fp32"},
     {"SPINS": 1 << 24, "REPLY_HEADER": 16, "BLOCK": 1024}),
    ("_split_kernel", "engine.kernels.hybrid_split",
     {"ids_ptr": "*i64", "slot_ptr": "*i64", "codes_ptr": "*i32", "stage_codes_ptr": "*i32", "stage_ptr": "*i32",
      "hits_ptr": "*i64", "pending_ptr": "*i32", "mb_i": "*i32", "mb_f": "*fp32", "seq_ptr": "*i32", "x_ptr": "*bf16",
      "w_ptr": "*fp32", "share": "fp32", "pf_ptr": "*i32", "pf_hits_ptr": "*i64", "warm_ptr": "*i32"},
     {"P": 8, "K": 8, "MAX_PAIRS": 128, "HEADER": 32, "BLOCK_P": 16, "BLOCK": 1024, "PUBLISH": True, "APART": True,
      "M": 2, "MW": 2}),
    ("_select_kernel", "engine.kernels.hybrid_split",
     {"pred_ptr": "*i64", "slot_ptr": "*i64", "out_ptr": "*i32", "sent_ptr": "*i64", "warm_ptr": "*i32",
      "mb_i": "*i32", "wseq_ptr": "*i32", "bus_i": "*i32", "bseq_ptr": "*i32"},
     {"K": 8, "M": 1, "MW": 2, "PUBLISH": True, "BUS": False, "BLOCK_K": 8, "WARM_SEQ": 20, "WARM_LAYER": 21,
      "WARM_N": 22, "WARM_IDS": 24, "BUS_LAYER": 1, "BUS_N": 2, "BUS_IDS": 8}),
    ("_select_kernel", "engine.kernels.hybrid_split",
     {"pred_ptr": "*i64", "slot_ptr": "*i64", "out_ptr": "*i32", "sent_ptr": "*i64", "warm_ptr": "*i32",
      "mb_i": "*i32", "wseq_ptr": "*i32", "bus_i": "*i32", "bseq_ptr": "*i32"},
     {"K": 8, "M": 2, "MW": 2, "PUBLISH": True, "BUS": True, "BLOCK_K": 8, "WARM_SEQ": 20, "WARM_LAYER": 21,
      "WARM_N": 22, "WARM_IDS": 24, "BUS_LAYER": 1, "BUS_N": 2, "BUS_IDS": 8}),
    ("_bus_wait_kernel", "engine.kernels.host_share_triton",
     {"flag_ptr": "*i32", "seq_ptr": "*i32", "bus_i": "*i32"},
     {"SPINS": 1 << 24, "BUS_STATUS": 3}),
], ids=["collect_into", "collect", "split_publish", "select_warm", "select_copier", "copier_wait"])
def test_host_share_launches_compile_with_system_scope_accesses(name, module, types, consts, tmp_path):
    """The launches that talk to the CPU threads and the copier build for sm_90 (they run only on CUDA): the waits'
    acquire loads and the publications' fence and release store at system scope (a job's, a warm-up's, a copier
    job's), in the PTX."""
    out = _sass(name, types, consts, 4, tmp_path, module=module, ptx=True)
    if name in ("_split_kernel", "_select_kernel"):
        assert "fence.sc.sys" in out and "st.release.sys" in out
    else:
        assert "ld.acquire.sys" in out


@pytest.mark.parametrize("rows,k,tile", [(5, 256, (2, 256, 1)), (4, 768, (2, 256, 1)), (7, 256, (16, 64, 4)),
                                         (9, 256, (2, 256, 1)), (17, 256, (2, 256, 1)), (17, 768, (4, 256, 1))])
def test_few_rows_linear_kernel_compiles_without_spills(rows, k, tile, tmp_path):
    """The float32 projection for fewer than 8 rows (a verify block at spec_len 4, a draft block of 4) at the
    shipped target's and draft's K, at the default tile and a wide one, and for the verify blocks of spec_len 8
    and 16 (9 and 17 rows, ``LUCE_TUNE_FEW_ROWS=18``): its weight tile read in 16-byte vectors, its products kept
    in registers."""
    block_n, block_k, warps = tile
    types = {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32"}
    consts = {"M": rows, "K": k, "BLOCK_M": 1 << (rows - 1).bit_length(), "BLOCK_N": block_n, "BLOCK_K": block_k}
    sass = _sass("_rows_kernel", types, consts, warps, tmp_path, module="engine.kernels.skinny")
    ops = re.findall(r"\b(LDG\.E\.\w+|LDG\.E|LDL|STL)\b", sass)
    assert "LDL" not in ops and "STL" not in ops, sorted(set(ops))
    assert ops.count("LDG.E.128") >= 1, sorted(set(ops))


_WAIT = {"SPINS": 1 << 24}
_WAITS = {"_bus_wait_kernel": dict(_WAIT, BUS_STATUS=3),
          "_collect_kernel": dict(_WAIT, REPLY_HEADER=16, BLOCK=1024),
          "_collect_into_kernel": dict(_WAIT, N=2048, REPLY_HEADER=16, BLOCK=1024, POOL=True, TWO=True)}


@pytest.mark.parametrize("name", sorted(_WAITS))
def test_bounded_waits_compile_and_look_at_their_status(name, tmp_path):
    """The device's waits on host words (the copier's flag, the threads' reply) build for sm_90, and each reads
    four words at system scope: the awaited word before and inside its loop, the status word inside the loop (an
    earlier wait that gave up ends this one) and once after it (a failure already there is kept)."""
    types = {"reply_f": "*fp32", "out_ptr": "*fp32", "acc_ptr": "*fp32", "acc2_ptr": "*fp32", "dst_ptr": "*bf16",
             "flag_ptr": "*i32", "seq_ptr": "*i32", "bus_i": "*i32", "reply_i": "*i32", "pending_ptr": "*i32"}
    sass = _sass(name, types, _WAITS[name], 4, tmp_path, module="engine.kernels.host_share_triton", ptx=True)
    assert sass.count("ld.acquire.sys.global.b32") == 4, name
