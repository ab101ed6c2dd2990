"""Re-prefilled tokens of the three harness edit patterns under each recurrent-checkpoint policy.

For a hybrid (recurrent) model, each policy replays the same synthetic agent session, edited as each
harness edits it, at the same checkpoint budget; per turn it reports the tokens re-prefilled against
the genuinely new suffix (the prompt past its common prefix with what the engine holds), the least any
cache could re-prefill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken.replay.harness import requests_for, synthetic_session
from freetoken.replay.session import replay_in_process
from freetoken.runtime.config import EngineConfig, MoeConfig
from freetoken.runtime.engine import Engine

# name -> (policy, interval)
POLICIES = {
    "anchors": ("anchors", 64),
    "interval-64": ("interval", 64),
    "interval-512": ("interval", 512),
    "none": ("none", 64),
}
EDITS = ("openclaw", "opencode", "swe-agent")


def compare(
    model: Path,
    budget: int = 8,
    turns: int = 8,
    output_tokens: int = 8,
    window: int = 2,
    max_tokens: int = 4,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """One row per (policy, edit): per-turn re-prefilled and suffix tokens, totals from turn 1 on."""
    session = synthetic_session(turns, output_tokens=output_tokens)
    rows = []
    for edit in EDITS:
        requests = [
            {"messages": m, "max_tokens": max_tokens} for m in requests_for(session, edit, window=window)
        ]
        for name, (policy, interval) in POLICIES.items():
            config = EngineConfig(
                model,
                device,
                "float32",
                MoeConfig("fused"),
                state_checkpoints=budget,
                checkpoint_policy=policy,
                checkpoint_interval=interval,
            )
            engine = Engine(config)
            try:
                reports = replay_in_process(engine, requests)
                memory = sum(checkpoint.nbytes for checkpoint in engine.checkpoints)
            finally:
                engine.close()
            reprefilled = [r.reprefilled_tokens for r in reports]
            suffix = [r.suffix_tokens for r in reports]
            rows.append(
                {
                    "edit": edit,
                    "policy": name,
                    "reprefilled": reprefilled,
                    "suffix": suffix,
                    "total_reprefilled": sum(reprefilled[1:]),
                    "total_suffix": sum(suffix[1:]),
                    "ratio": sum(reprefilled[1:]) / max(sum(suffix[1:]), 1),
                    "checkpoint_bytes": memory,
                }
            )
    return rows
