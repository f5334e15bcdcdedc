"""Chapter 9: the scheduler as plain data. Requests, KV blocks and recent steps, bounded in size.

What the classroom page draws (the server serves it; the engine only describes itself): each
request's state, TTFT and tokens, each KV block's owner and reference count, the recent steps.
The engine calls `scheduler_snapshot` between two steps, so nothing changes while it is read.
"""

from __future__ import annotations

from minivllm.scheduler import tenant_of

MAX_ROWS = 64            # request rows in one snapshot; past it, "rows_total" says how many there were
MAX_BLOCKS = 4096        # KV blocks drawn; past it, "blocks.shown" < "blocks.total"
FINISHED_KEEP_S = 5.0    # a finished request stays on the page this long
RATE_WINDOW_S = 5.0      # steps/s and tokens/s over the last seconds


# --8<-- [start:snapshot]
def request_row(r, state: str, now: float) -> dict:
    """One request as a row of the page: where it stands, its TTFT and its tokens so far."""
    return {"id": r.id, "state": state, "prompt_tokens": r.n_prompt, "tokens": len(r.new_ids),
            "budget": r.budget, "computed": r.num_computed, "total": r.num_tokens,
            "cached_tokens": r.cached_tokens or 0, "preemptions": r.preemptions,
            "ttft_ms": round((r.t_first - r.arrival) * 1000, 1) if r.t_first else None,
            "age_s": round(now - r.arrival, 2), "finish_reason": r.finish_reason,
            "tenant": tenant_of(r)}   # the server shows a tenant's key its own rows only


def running_state(r) -> str:
    """prefill while more than its newest token lacks K/V (chunk by chunk), then decode."""
    return "prefill" if r.num_tokens - r.num_computed > 1 else "decode"


def scheduler_snapshot(scheduler, blocks, finished, step_log, num_steps: int, arriving: list, now: float,
             max_rows: int = MAX_ROWS, max_blocks: int = MAX_BLOCKS) -> dict:
    """The scheduler's queues as rows (running, then waiting, then recently finished), the pool as
    one owner and one reference count per block, and the recent steps. `arriving`: requests handed
    to the engine that the scheduler takes at its next step. Read only: the caller makes sure
    nothing changes meanwhile (the engine loop answers between two steps)."""
    rows = [request_row(r, running_state(r), now) for r in scheduler.running]
    rows += [request_row(r, "preempted" if r.preemptions else "waiting", now)
             for r in [*scheduler.waiting, *arriving]]
    rows += [{**row, "ago_s": round(now - t, 2)} for t, row in reversed(finished) if now - t <= FINISHED_KEEP_S]
    shown = min(blocks.num_blocks, max_blocks)
    owner = [-1] * shown
    for seq, table in blocks.tables.items():       # oldest sequence first: a shared block shows its first owner
        for b in table:
            if b < shown and owner[b] < 0:
                owner[b] = seq
    cached = getattr(blocks, "content", {}) if blocks.caches_prefixes else {}
    recent = [s for s in step_log if now - s[1] <= RATE_WINDOW_S]
    return {
        "available": True, "step": num_steps, "waiting": len(scheduler.waiting) + len(arriving),
        "running": len(scheduler.running), "preemptions": scheduler.num_preemptions,
        "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "rows": rows[:max_rows], "rows_total": len(rows),
        "blocks": {"total": blocks.num_blocks, "shown": shown, "block_size": blocks.block_size,
                   "free": blocks.num_free, "prefix_caching": blocks.caches_prefixes,
                   "owner": owner, "refs": blocks.ref_counts[:shown],
                   "cached": [1 if b in cached else 0 for b in range(shown)] if cached else []},
        "steps": [[n, batch, tokens] for n, _, batch, tokens in step_log],   # [step, batch size, new tokens]
        "steps_per_s": round(len(recent) / RATE_WINDOW_S, 2),
        "tokens_per_s": round(sum(s[3] for s in recent) / RATE_WINDOW_S, 2),
        "window_s": RATE_WINDOW_S}
# --8<-- [end:snapshot]
