"""Chapter 6: a weight is a linear operation. The one interface every later weight keeps.

The model reads each weight matrix in one place (`LlamaModel.linear`), through `matmul` below.
A tensor is a weight; so is any object with the same operations, which is how Chapter 12 stores
weights in fewer bits, Chapter 13 packs them for a kernel and Chapter 14 splits them over
processes, without the forward pass changing and in any combination.
"""

from __future__ import annotations

import torch


def input_major(w: torch.Tensor) -> torch.Tensor:
    """The same [out, in] matrix, laid out in memory input by input (column-major).

    `x @ w.T` then hands the BLAS a plain [in, out] matrix, no transpose. How much that gains
    depends on the CPU and on the kernel the BLAS picks for each shape: on the book's capture
    machine (a 2-core AMD EPYC, one thread; `python 10_profile.py --layouts`) the layers' matmuls
    ran 1.4x as fast at 1 and 2 rows, and within a few percent either way at 4 to 32 rows.
    """
    return w.T.contiguous().T


# --8<-- [start:linear]
# A weight is a tensor, or an object with the same two operations: `matmul(x)` (x @ Wᵀ) and,
# for a table, `w[ids]` (rows). Later chapters hand the model such objects: quantised weights
# (Chapter 12), weights packed for a kernel (Chapter 13), a shard that talks to its peers
# (Chapter 14). They wrap each other, so the features stack, and the forward pass never changes.
def matmul(w, x: torch.Tensor) -> torch.Tensor:
    """x @ Wᵀ for a plain tensor or a weight object."""
    return x @ w.T if isinstance(w, torch.Tensor) else w.matmul(x)


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def unique(weights) -> list:
    """Each weight once (a tied LM head is the embedding table again)."""
    return list({id(w): w for w in weights}.values())


def map_weights(model, change, names=None) -> dict:
    """The model's weights with `change(name, w)` applied to each leaf: the tensor, or the
    innermost weight a wrapper (`.wrapped`, rebuilt with `.replace(wrapped)`) holds. A tied
    table changes once and stays tied."""
    done: dict[int, object] = {}

    def leaf(name, w):
        if hasattr(w, "wrapped"):
            return w.replace(leaf(name, w.wrapped))
        return change(name, w)

    out = {}
    for name, w in model.w.items():
        if names is not None and name not in names:
            out[name] = w
        elif id(w) not in done:
            out[name] = done[id(w)] = leaf(name, w)
        else:
            out[name] = done[id(w)]
    return out
# --8<-- [end:linear]
