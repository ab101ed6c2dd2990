"""/health, /metrics (Prometheus text format) and /v1/stats (the same numbers as JSON)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, PlainTextResponse

from freetoken.serve.state import ServeState

router = APIRouter()


def snapshot(state: ServeState) -> dict[str, Any]:
    batcher, engine = state.batcher, state.batcher.engine
    s, uptime = batcher.stats, max(time.monotonic() - batcher.started_at, 1e-9)
    moe = engine.moe_counters.totals()
    executor = engine.executor
    residency = getattr(executor, "residency", None)
    occupied = residency.resident_count() if residency is not None else 0
    layer_steps = engine.moe_counters.steps * max(len(engine.moe_counters.moe_layers), 1)
    prefix = batcher.prefix.stats
    pool = engine.pool.describe() if engine.pool is not None else {"bytes": 0, "dtypes": []}
    return {
        "model": state.model_names[0],
        "uptime_s": round(uptime, 3),
        "requests": {
            "submitted": s.submitted,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "rejected": s.rejected,
            "failed": s.failed,
            "running": batcher.running,
            "queued": batcher.queued,
        },
        "tokens": {
            "prompt": s.prompt_tokens,
            "cached": s.cached_tokens,
            "generated": s.generated_tokens,
            "generated_per_s": round(s.generated_tokens / uptime, 3),
        },
        "ttft_s_mean": round(s.ttft_s_sum / s.ttft_count, 6) if s.ttft_count else None,
        "decode": {
            "steps": s.decode_steps,
            "mean_batch": round(s.batched_rows / s.decode_steps, 3) if s.decode_steps else 0,
        },
        "experts": {
            "backend": engine.backend,
            "hits": moe["hits"],
            "misses": moe["misses"],
            "fills": moe["fills"],
            "cpu": moe["cpu"],
            "streamed": moe["streamed"],
            "fills_per_layer_step": round(moe["fills"] / layer_steps, 4) if layer_steps else 0.0,
            "slots": engine.num_slots,
            "slots_occupied": occupied,
            "pool_dtypes": pool["dtypes"],  # the codecs the host pool keeps experts in
        },
        "memory": {
            **{k: v for k, v in engine.memory_report().items() if k != "vram_budget"},
            "expert_pool_bytes": pool["bytes"],
        },
        "prefix_cache": {
            "lookups": prefix.lookups,
            "hit_tokens": prefix.hit_tokens,
            "stored_tokens": prefix.stored_tokens,
            "nodes": prefix.nodes,
            "evicted_tokens": prefix.evicted_tokens,
        },
    }


# Totals that only grow while the server runs: Prometheus counters (named `..._total`); the rest are gauges.
COUNTERS = {
    "requests": {"submitted", "finished", "cancelled", "rejected", "failed"},
    "tokens": {"prompt", "cached", "generated"},
    "decode": {"steps"},
    "experts": {"hits", "misses", "fills", "cpu", "streamed"},
    "prefix_cache": {"lookups", "hit_tokens", "evicted_tokens"},
    "memory": {"resplits"},
}


def prometheus(doc: dict[str, Any]) -> str:
    """Flatten the snapshot into `freetoken_<group>_<name>` gauges and `..._total` counters."""
    lines = []
    for group in ("requests", "tokens", "decode", "experts", "memory", "prefix_cache"):
        for name, value in doc[group].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metric = f"freetoken_{group}_{name}"
                if name in COUNTERS[group]:
                    lines += [f"# TYPE {metric}_total counter", f"{metric}_total {value}"]
                else:
                    lines += [f"# TYPE {metric} gauge", f"{metric} {value}"]
    lines += [
        "# TYPE freetoken_ttft_seconds_mean gauge",
        f"freetoken_ttft_seconds_mean {doc['ttft_s_mean'] or 0}",
    ]
    lines += ["# TYPE freetoken_uptime_seconds gauge", f"freetoken_uptime_seconds {doc['uptime_s']}"]
    return "\n".join(lines) + "\n"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine loop serves; 503 with the reason when it died, stalls, or the server drains."""
    state: ServeState = request.app.state.serve
    batcher = state.batcher
    counts = {"running": batcher.running, "queued": batcher.queued}
    problem = batcher.health() or ("shutting down" if state.draining else None)
    if problem is not None:
        return JSONResponse({"status": "unavailable", "reason": problem, **counts}, status_code=503)
    return JSONResponse({"status": "ok", **counts})


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(
        prometheus(snapshot(request.app.state.serve)), media_type="text/plain; version=0.0.4"
    )


@router.get("/v1/stats")
async def stats(request: Request) -> JSONResponse:
    return JSONResponse(snapshot(request.app.state.serve))
