"""What `run` does once its options are parsed: load the engine, answer once or chat."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from freetoken.errors import FreeTokenError

if TYPE_CHECKING:
    from freetoken.runtime.config import MoeConfig
    from freetoken.runtime.engine import Engine
    from freetoken.runtime.sampling import SamplingParams
    from freetoken.runtime.sequence import GenerationStats, TokenEvent

FALLBACK_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@dataclass(frozen=True)
class RunOptions:
    model: str
    raw: bool
    system: str | None
    max_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    device: str
    dtype: str
    moe: MoeConfig
    verify: bool | None
    max_prefill_tokens: int
    as_json: bool
    record_routing: Path | None = None
    state_checkpoints: int = 16
    checkpoint_policy: str = "anchors"
    context_length: int | None = None


def _stderr() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def load_engine(
    model: str,
    device: str,
    dtype: str,
    moe: MoeConfig,
    max_prefill_tokens: int = 8192,
    verify: bool | None = None,
    quiet: bool = False,
    **engine_options: Any,
) -> Engine:
    """Resolve the model, load it with a progress bar on stderr, and say what runs where.
    `engine_options` are further EngineConfig fields (state_checkpoints, checkpoint_policy, ...)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from freetoken.cli.verbosity import quiet as asked_quiet
    from freetoken.runtime.config import EngineConfig
    from freetoken.runtime.devices import dtype_name
    from freetoken.runtime.engine import Engine
    from freetoken.runtime.loading.demo import is_random_model
    from freetoken.runtime.loading.generation_config import generation_defaults
    from freetoken.runtime.loading.model_ref import resolve_model
    from freetoken.runtime.moe.executor import CACHED_BACKENDS

    quiet = quiet or asked_quiet()  # `ft -q`: no banner, no progress
    err = _stderr()
    if model == "demo" and not quiet:
        err.print("[dim]preparing the demo model…[/dim]")
    path = resolve_model(model)
    generation_defaults(path)  # a broken generation_config.json fails before the weights load
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=quiet or not err.is_terminal,
    ) as bar:
        task = bar.add_task("loading weights", total=None)
        config = EngineConfig(
            path,
            device,
            dtype,
            moe,
            max_prefill_tokens=max_prefill_tokens,
            verify=verify,
            **engine_options,
        )
        engine = Engine(config, progress=lambda done, total: bar.update(task, completed=done, total=total))
    if not quiet:
        if is_random_model(path):
            err.print(
                f"[yellow]note:[/yellow] {path.name} has random weights: the text is noise; "
                "it shows the engine running."
            )
        slots = f" · {engine.num_slots} expert slots" if engine.backend in CACHED_BACKENDS else ""
        where = f"{path} · {engine.device} · {dtype_name(engine.dtype)} · moe backend {engine.backend}"
        err.print(f"[dim]{where}{slots}[/dim]")
    return engine


def _load(opts: RunOptions) -> Engine:
    engine = load_engine(
        opts.model,
        opts.device,
        opts.dtype,
        opts.moe,
        opts.max_prefill_tokens,
        opts.verify,
        opts.as_json,
        state_checkpoints=opts.state_checkpoints,
        checkpoint_policy=opts.checkpoint_policy,
        max_seq_len=opts.context_length,
    )
    if opts.record_routing is not None:
        from freetoken.replay.recorder import attach_recorder

        attach_recorder(engine)
    return engine


def save_routing(engine: Engine, path: Path | None, quiet: bool = False) -> None:
    """Write the recorded routing trace (when --record-routing was given)."""
    if path is None or engine.recorder is None:
        return
    engine.recorder.save(path)
    if not quiet:
        _stderr().print(f"[dim]routing of {engine.recorder.passes} passes written to {path}[/dim]")


def sampling_params(opts: RunOptions, engine: Engine) -> SamplingParams:
    from freetoken.runtime.loading.generation_config import generation_defaults
    from freetoken.runtime.sampling import SamplingParams

    defaults = {**FALLBACK_SAMPLING, **generation_defaults(engine.engine_config.model_path)}
    return SamplingParams(
        temperature=opts.temperature if opts.temperature is not None else float(defaults["temperature"]),
        top_p=opts.top_p if opts.top_p is not None else float(defaults.get("top_p", 1.0)),
        top_k=opts.top_k if opts.top_k is not None else int(defaults.get("top_k", 0)),
        seed=opts.seed,
        max_tokens=opts.max_tokens,
        stop=opts.stop,
    )


def stats_line(stats: GenerationStats, engine: Engine) -> str:
    line = (
        f"{stats.prompt_tokens} prompt tokens ({stats.cached_tokens} cached) · "
        f"{stats.completion_tokens} generated · prefill {stats.prefill_tok_s:.1f} tok/s · "
        f"decode {stats.decode_tok_s:.1f} tok/s · first token {stats.ttft_s * 1000:.0f} ms"
    )
    counters = engine.moe_counters
    if counters.tokens and engine.num_slots == 0:
        line += f" · experts: {counters.per_token()['cpu']:.1f} per token computed from the host pool"
    elif counters.tokens:
        per_token = counters.per_token()
        line += (
            f" · experts: {100 * counters.miss_rate():.1f}% missed, {per_token['fills']:.1f} fetched and "
            f"{per_token['cpu']:.1f} on CPU per token"
        )
    return line


def _stream(events: Any, echo: bool) -> tuple[str, TokenEvent]:
    """The text of a request's events (echoed as they come); NaN/Inf logits raise NonFiniteLogits, a
    FreeTokenError that names the model."""
    parts = []
    last = None
    for event in events:
        parts.append(event.text)
        if echo and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        last = event
    assert last is not None and last.stats is not None
    return "".join(parts), last


def _messages(opts: RunOptions, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": opts.system}] if opts.system else []) + history


def run_once(opts: RunOptions, prompt: str) -> None:

    if not prompt.strip():
        raise FreeTokenError("empty prompt: pass --prompt TEXT or pipe text on stdin")
    engine = _load(opts)
    params = sampling_params(opts, engine)
    if opts.raw:
        ids = engine.tokenizer.encode(prompt)
    else:
        text = engine.tokenizer.apply_chat_template(
            _messages(opts, [{"role": "user", "content": prompt}]), add_generation_prompt=True
        )
        ids = engine.tokenizer.encode(text)
    engine.moe_counters.reset()
    try:
        text, last = _stream(engine.generate(ids, params), not opts.as_json)
    finally:
        save_routing(engine, opts.record_routing, quiet=opts.as_json)
    assert last.stats is not None
    if opts.as_json:
        doc = {
            "model": str(engine.engine_config.model_path),
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "moe_backend": engine.backend,
            "expert_slots": engine.num_slots,
            "experts": engine.moe_counters.as_dict(),
            "expert_pool": engine.pool.describe() if engine.pool is not None else None,
            "memory": engine.memory_report(),
            "text": text,
            "finish_reason": last.finish_reason,
            "stats": last.stats.as_dict(),
        }
        print(json.dumps(doc, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    from freetoken.cli.verbosity import quiet

    if not quiet():
        _stderr().print(f"[dim]{stats_line(last.stats, engine)}[/dim]")


def run_chat(opts: RunOptions) -> None:
    from freetoken.cli.chat import chat_loop

    engine = _load(opts)
    try:
        chat_loop(opts, engine)
    finally:
        save_routing(engine, opts.record_routing)
