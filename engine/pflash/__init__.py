"""PFlash speculative prefill: a small drafter scores the prompt's tokens, the target
prefills only the best chunks of them (REFERENCE.md section 4).

``drafter`` loads and runs the drafter, ``score`` / ``score_triton`` turn its attention into
token scores, ``select`` keeps chunks, ``prefill`` feeds the kept tokens to the target.
The Triton module is imported only when a CUDA scorer is used.
"""

from engine.pflash.drafter import Drafter
from engine.pflash.prefill import CompressedPrefill, compressed_prefill
from engine.pflash.select import PFlashConfig, Selection, pflash_select

__all__ = ["CompressedPrefill", "Drafter", "PFlashConfig", "Selection", "compressed_prefill", "pflash_select"]
