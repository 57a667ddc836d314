"""Run an engine's requests to their end, as a caller of `Engine.step()` does."""


def drive(engine, rids, cancel=None, cancel_after: int = 2):
    """Step `engine` while it has unfinished requests, aborting request `cancel` (if any)
    after `cancel_after` steps; the token ids and finish reason of each of `rids`."""
    toks, ends, steps = {r: [] for r in rids}, {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            toks[o.request_id] += o.token_ids
            ends[o.request_id] = o.finish_reason
        steps += 1
        if steps == cancel_after and cancel is not None:
            engine.abort(cancel)
    return [(toks[r], ends[r]) for r in rids]
