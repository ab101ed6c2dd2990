"""`freetoken serve`: OpenAI- and Anthropic-compatible HTTP server over one engine."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from freetoken.cli.engine_flags import EngineFlags, engine_flags
from freetoken.cli.errors import reports_errors, warning_line
from freetoken.cli.options import ModelArg


@reports_errors
@engine_flags
def serve(
    model: ModelArg = "demo",
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="FREETOKEN_API_KEY",
            help="Require this key (Authorization: Bearer, or x-api-key) on every API request.",
        ),
    ] = None,
    max_running_requests: Annotated[
        int, typer.Option("--max-running-requests", min=1, help="Sequences decoded together; more wait.")
    ] = 4,
    max_queued_requests: Annotated[
        int, typer.Option("--max-queued-requests", min=0, help="Waiting requests before answering 429.")
    ] = 64,
    prefix_cache_tokens: Annotated[
        int,
        typer.Option(
            "--prefix-cache-tokens", min=0, help="Tokens of KV kept for reuse across requests (0: off)."
        ),
    ] = 65536,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option("--served-model-name", help="Model name(s) reported by /v1/models (repeatable)."),
    ] = None,
    max_body_mib: Annotated[
        int, typer.Option("--max-body-mib", min=1, help="Largest request body accepted (413 above).")
    ] = 32,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            "--shutdown-timeout",
            min=0,
            help="On SIGTERM/SIGINT, seconds running requests may take to finish before they are ended "
            "(a second signal exits at once).",
        ),
    ] = 30.0,
    watchdog: Annotated[
        float,
        typer.Option(
            "--watchdog-s",
            min=0,
            help="Seconds without a finished forward pass while requests wait: then they fail and "
            "/health answers 503 until the engine moves again (0: off).",
        ),
    ] = 600.0,
    public_metrics: Annotated[
        bool, typer.Option("--public-metrics", help="Serve /metrics and /v1/stats without the API key.")
    ] = False,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-hosts",
            help="Host header names accepted besides the loopback ones when bound to a loopback address "
            "(repeatable; others get 403, against DNS rebinding).",
        ),
    ] = None,
    cors_origins: Annotated[
        list[str] | None,
        typer.Option(
            "--cors-origins", help="Origins allowed by CORS (repeatable; '*' for any). Off by default."
        ),
    ] = None,
    *,
    flags: EngineFlags,
) -> None:
    """Serve a model over HTTP: /v1/chat/completions, /v1/completions, /v1/messages, /metrics."""
    from freetoken.cli.session import load_engine, save_routing
    from freetoken.runtime.batcher import Batcher
    from freetoken.serve.lifecycle import address_lines, bind_socket, serve_forever
    from freetoken.serve.state import ServeConfig, ServeState, host_allowlist

    sock = bind_socket(host, port)  # a port in use fails now, not after the model loads
    engine = load_engine(
        model,
        flags.device,
        flags.dtype,
        flags.moe,
        flags.max_prefill_tokens,
        flags.verify,
        max_seq_len=flags.context_length,
        max_running=max_running_requests,
    )
    if flags.record_routing is not None:
        from freetoken.replay.recorder import attach_recorder

        attach_recorder(engine)
    batcher = Batcher(
        engine, max_running_requests, max_queued_requests, prefix_cache_tokens, watchdog_s=watchdog or None
    )
    names = tuple(served_model_name or ()) or (
        model if model == "demo" else engine.engine_config.model_path.name,
    )
    config = ServeConfig(
        api_key=api_key,
        max_body_bytes=max_body_mib << 20,
        public_metrics=public_metrics,
        allowed_hosts=host_allowlist(host, tuple(allowed_hosts or ())),
        cors_origins=tuple(cors_origins or ()),
        shutdown_timeout_s=shutdown_timeout,
    )
    state = ServeState(batcher, names, config)
    address, warning = address_lines(sock, names, api_key is not None)
    print(address, file=sys.stderr, flush=True)
    if warning is not None:
        warning_line(warning)
    batcher.start()
    try:
        serve_forever(state, sock)
    finally:
        batcher.stop(timeout=2.0)
        save_routing(engine, flags.record_routing)
        engine.close()
