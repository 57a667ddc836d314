"""Adapters per row of a batch: each row's own runtime adapters in one forward.

The batch runner wraps each forward in `selected(per_row)`: for every adapter that some row
selects, a boolean row mask; `engine.adapters.lora.LoRALinear` then adds that adapter's
update to the rows whose mask is on (`mx.where`: the other rows keep the base output bit for
bit) instead of following the adapter's global on/off switch. An adapter no row selects is not
in the selection and follows its switch (the registry switches every runtime adapter off for
the batch; an adapter mounted at load, `--adapter-path`, stays on for every row).

Each row computes what it computes alone with its adapters switched on wherever a row's
values do not depend on the other rows of the forward (the CPU: tests/engine/test_adapter_rows.py):
the update's two matmuls run over every row, the mask picks. The selection lives in a context
variable, so it is the calling thread's only (the engine's worker)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional, Sequence

import mlx.core as mx

__all__ = ["selected", "row_mask"]

_ROWS: ContextVar[Optional[dict]] = ContextVar("mlxp_adapter_rows", default=None)


@contextmanager
def selected(per_row: Sequence[tuple]):
    """Within it, row b of a forward gets exactly the runtime adapters `per_row[b]` (ids)."""
    names = {n for ids in per_row for n in ids}
    if not names:
        yield
        return
    sel = {n: mx.array([n in ids for ids in per_row]) for n in names}
    token = _ROWS.set(sel)
    try:
        yield
    finally:
        _ROWS.reset(token)


def row_mask(name: str, ndim: int) -> Optional[mx.array]:
    """The rows that take adapter `name` in the current forward, shaped to broadcast over an
    output of `ndim` dims; None where no selection is in force or no row selects it."""
    sel = _ROWS.get()
    m = None if sel is None else sel.get(name)
    return None if m is None else m.reshape((-1,) + (1,) * (ndim - 1))
