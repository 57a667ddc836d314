"""The verify experiments' negative control: every call row of a verify at its row's first
verified column (its tokens' keys all written at one column)."""

import mlx.core as mx

from engine.fast.decode import FastStep


def calls_at_one_column(monkeypatch) -> None:
    real = FastStep.__call__

    def flat(self, tokens, pos, active, keys, values, crow=None):
        if crow is not None:
            pos = mx.broadcast_to(mx.min(pos), pos.shape)
        return real(self, tokens, pos, active, keys, values, crow=crow)
    monkeypatch.setattr(FastStep, "__call__", flat)
