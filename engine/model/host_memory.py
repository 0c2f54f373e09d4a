"""Host memory the device reads in place: pinned tensors seen as device tensors (no copy).

Pinned memory is mapped into a CUDA device's address space at the same address, so a kernel can
read it over the bus as it reads its own memory, inside a CUDA graph too. The cold expert tier of
``engine.hybrid`` (``cold_device="gpu"``) and the token embedding (``engine.model.weights``) live
there.
"""

from __future__ import annotations

import torch


def mapped_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``, in host memory, as a tensor of ``device`` that the device reads over the bus.

    On CUDA ``t`` must be pinned: pinned memory is mapped into the device's address space at the
    same address, and the view is made through ``__cuda_array_interface__`` (it keeps ``t`` alive).
    On a CPU device the view is ``t`` itself."""
    if device.type != "cuda":
        return t
    if not t.is_pinned():
        raise ValueError("only pinned host memory can be read by the device in place")
    if not t.is_contiguous():
        raise ValueError("a mapped view needs a contiguous tensor")
    flat = torch.as_tensor(_HostArray(t), device=device)  # uint8 [nbytes], no copy
    view = flat.view(t.dtype).view(t.shape)
    if view.data_ptr() != t.data_ptr():
        raise RuntimeError("the mapped view does not alias the host memory")
    return view


class _HostArray:
    """The bytes of a pinned host tensor, offered to torch as device memory (CUDA array interface)."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # kept alive by the view
        self.__cuda_array_interface__ = {"shape": (t.numel() * t.element_size(),), "typestr": "|u1",
                                         "data": (t.data_ptr(), False), "version": 3}
