"""SGLang's `/abort_request` for the embedded engine: end chosen requests now, with what they have.

`{"rid": "<id>"}` aborts that request, `{"abort_all": true}` every queued and running one (Miles'
rollout aborts all in-flight generation once dynamic sampling has its groups). An aborted request
answers at once with finish_reason `{"type": "abort"}` and everything generated so far (tokens,
log-probs, the extras it asked for): --partial-rollout keeps that partial response and continues
it in the next rollout. Unlike `/pause_generation` the engine keeps serving: requests that come
later run as usual.
"""

from __future__ import annotations

from miles_platform.rollout.engine_batch import keep_rows

ABORTED = {"type": "abort", "message": "aborted by /abort_request"}


def abort_requests(core, rid: str | None = None, abort_all: bool = False) -> int:
    """Finish the queued and running requests named by `rid` (or all) with finish_reason abort, their
    partial output in the answer; returns how many were aborted. Between two scheduler steps."""
    if not abort_all and rid is None:
        return 0

    def chosen(r) -> bool:
        return abort_all or r.rid == rid

    with core._step_lock:
        with core._cv:
            queued = [r for r in core._waiting if chosen(r)]
            for r in queued:
                core._waiting.remove(r)
        b = core._batch
        running = [i for i, r in enumerate(b.reqs) if chosen(r)]
        for r in queued:
            core._finish(r, ABORTED)
        for i in running:
            core._finish(b.reqs[i], ABORTED)
        if running:
            gone = set(running)
            core._batch = keep_rows(b, [i for i in range(len(b)) if i not in gone], core.model.config)
    return len(queued) + len(running)
