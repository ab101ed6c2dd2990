"""`freetoken serve`: OpenAI- and Anthropic-compatible HTTP server over one engine."""

from __future__ import annotations

from typing import Annotated

import typer

from freetoken.cli.errors import reports_errors
from freetoken.cli.options import (
    CacheRatioOpt,
    CacheSizeOpt,
    ContextLengthOpt,
    CpuLayersOpt,
    CpuThreadsOpt,
    DeviceOpt,
    DtypeOpt,
    HostOpt,
    KvReserveOpt,
    MaxFetchOpt,
    ModelArg,
    MoeBackendOpt,
    NoPrefillOverlapOpt,
    PcieOpt,
    PrefillHitD2dOpt,
    PrefillStreamOpt,
    RecordRoutingOpt,
    VramBudgetOpt,
    moe_config_from,
)


@reports_errors
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
    max_prefill_tokens: Annotated[
        int, typer.Option("--max-prefill-tokens", min=1, help="Prompt tokens per forward pass.")
    ] = 8192,
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
    context_length: ContextLengthOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    moe_backend: MoeBackendOpt = "auto",
    moe_cache_size: CacheSizeOpt = None,
    moe_cache_ratio: CacheRatioOpt = None,
    kv_reserve_tokens: KvReserveOpt = 8192,
    vram_budget: VramBudgetOpt = None,
    moe_cpu_layers: CpuLayersOpt = None,
    moe_hybrid_max_fetch: MaxFetchOpt = None,
    moe_cpu_threads: CpuThreadsOpt = None,
    moe_pcie_gbps: PcieOpt = None,
    moe_host_gbps: HostOpt = None,
    moe_prefill_stream: PrefillStreamOpt = "auto",
    moe_prefill_hit_d2d: PrefillHitD2dOpt = False,
    disable_moe_prefill_overlap: NoPrefillOverlapOpt = False,
    record_routing: RecordRoutingOpt = None,
    no_reprofile: Annotated[
        bool, typer.Option("--no-reprofile", help="Do not re-measure B_P and B_H while serving.")
    ] = False,
) -> None:
    """Serve a model over HTTP: /v1/chat/completions, /v1/completions, /v1/messages, /metrics."""
    from freetoken.cli.session import load_engine, save_routing
    from freetoken.runtime.batcher import Batcher
    from freetoken.serve.lifecycle import bind_socket, serve_forever
    from freetoken.serve.state import ServeConfig, ServeState, host_allowlist

    moe = moe_config_from(locals())
    sock = bind_socket(host, port)  # a port in use fails now, not after the model loads
    engine = load_engine(
        model,
        device,
        dtype,
        moe,
        max_prefill_tokens,
        max_seq_len=context_length,
        max_running=max_running_requests,
    )
    if record_routing is not None:
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
    batcher.start()
    try:
        serve_forever(state, sock)
    finally:
        batcher.stop(timeout=2.0)
        save_routing(engine, record_routing)
        engine.close()
