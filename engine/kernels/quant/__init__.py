"""Matmuls against GGUF-quantized weights kept in their ggml block layout.

``QuantMatrix.matmul`` / ``QuantExperts.matmul`` pick the Triton kernels on CUDA and the
torch references elsewhere; the Triton module is imported on first use, so the CPU path
never needs Triton.
"""

from engine.kernels.quant.reference import (
    IMPLS,
    QTYPES,
    QuantExperts,
    QuantMatrix,
    qmatmul_experts_reference,
    qmatmul_reference,
    resolve_impl,
)

__all__ = ["IMPLS", "QTYPES", "QuantExperts", "QuantMatrix", "qmatmul_experts_reference", "qmatmul_reference",
           "resolve_impl"]
