"""`freetoken run`: one-shot generation or an interactive chat."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from freetoken.cli.engine_flags import EngineFlags, engine_flags
from freetoken.cli.errors import reports_errors
from freetoken.cli.options import CheckpointPolicyOpt, JsonOpt, ModelArg, StateCheckpointsOpt, in_kind
from freetoken.runtime.json_keys import FRACTION, NON_NEGATIVE, Kind

SEED = Kind("a 64-bit integer", lambda v: -(1 << 63) <= v < 1 << 64)  # what a torch.Generator takes


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


@reports_errors
@engine_flags
def run(
    model: ModelArg = "demo",
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            help="Prompt for one answer; '-' reads standard input. "
            "Without it: an interactive chat on a terminal, else the prompt is read from stdin.",
        ),
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Feed the prompt as is, without the chat template.")
    ] = False,
    system: Annotated[str | None, typer.Option("--system", help="System message for the chat.")] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", min=1, help="Most tokens to generate.")
    ] = 256,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature",
            "-t",
            callback=in_kind("--temperature", NON_NEGATIVE),
            help="0 is greedy. Default: the model's generation_config.json, else 0.7.",
        ),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            "--top-p", callback=in_kind("--top-p", FRACTION), help="Nucleus sampling mass, in (0, 1]."
        ),
    ] = None,
    top_k: Annotated[
        int | None, typer.Option("--top-k", min=0, help="Sample from the k likeliest (0: all).")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option("--seed", callback=in_kind("--seed", SEED), help="Random seed for sampling."),
    ] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    state_checkpoints: StateCheckpointsOpt = 16,
    checkpoint_policy: CheckpointPolicyOpt = "anchors",
    as_json: JsonOpt = False,
    *,
    flags: EngineFlags,
) -> None:
    """Generate text with a model: one answer for --prompt, or chat interactively."""
    from freetoken.cli.session import RunOptions, run_chat, run_once

    opts = RunOptions(
        model=model,
        raw=raw,
        system=system,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
        device=flags.device,
        dtype=flags.dtype,
        moe=flags.moe,
        verify=flags.verify,
        max_prefill_tokens=flags.max_prefill_tokens,
        as_json=as_json,
        record_routing=flags.record_routing,
        state_checkpoints=state_checkpoints,
        checkpoint_policy=checkpoint_policy,
        context_length=flags.context_length,
    )
    if prompt is None and stdin_is_terminal() and not as_json:
        run_chat(opts)
        return
    text = sys.stdin.read() if prompt in (None, "-") else prompt
    run_once(opts, text)
