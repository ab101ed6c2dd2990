"""`ft help TOPIC`: short man pages on the ideas behind the flags (backends, formats, q*); `ft help COMMAND`
prints that command's --help."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from freetoken.errors import FreeTokenError

TOPICS: dict[str, str] = {
    "backends": """\
# MoE backends (--moe-backend)

The expert pool lives in host RAM and is the source of truth. The GPU holds a cache of expert slots,
driven by one global LRU that follows the router. Each MoE layer step, the router's experts are
hits (already in a slot) or misses. The backend decides where misses go:

- **fused**: every expert resident on the device; no misses. Needs room for the whole pool.
- **offload**: every miss is fetched over PCIe into a slot, then computed there. The decode step
  stays on the device, so it is captured in a CUDA graph.
- **cpu**: misses are computed on the CPU, from the pool; the slots keep their warm set. On a machine
  without a GPU this is the only backend, with no slots at all.
- **hybrid**: a step's m misses are split: q* are fetched, the rest computed on the CPU at the same
  time (see `ft help qstar`).
- **auto** (default): fused without MoE layers; cpu without CUDA; else what `ft bench bw` measured as
  best on this machine, else offload (hybrid when --moe-pcie-gbps and --moe-host-gbps say the CPU
  reads faster than PCIe moves).

Sizing: --moe-cache-size N slots, or --moe-cache-ratio F of the pool, or --vram-budget for the
whole GPU (weights, KV and slots). --moe-cpu-layers runs given layers' misses on the CPU.
""",
    "formats": """\
# Model formats

MODEL (for `run`, `serve`, `convert`) is one of:

- **a Hugging Face folder**: config.json, tokenizer files and safetensors shards, as
  `save_pretrained` writes them. A repo id already in the local Hugging Face cache works too
  (FreeToken does not download).
- **an FTW folder**, written by `ft convert SRC OUT`: the experts pre-merged into the pool's own
  layout ([E, 2I, H] gate+up, [E, H, I] down), every tensor 4096-aligned and checksummed, so loading
  is straight parallel reads into the final buffers. `ft convert --verify FOLDER` checks every
  checksum; `run --verify` checks them as the weights land.
- **a .gguf file** (llama.cpp's format): F32/F16/BF16 tensors are taken as stored, quantized types
  are dequantized on load with the `gguf` package.
- **demo**: a small random Qwen3-MoE generated on first use, to see the engine run with no download.

`ft models` lists what is available; FreeToken's own models live in $FREETOKEN_HOME/models and run
by bare name.
""",
    "qstar": """\
# q*: how a step's misses split between PCIe and the CPU

Two bandwidths decide it, both measured on this machine by `ft bench bw` (and re-probed while
running, so they follow contention):

- **B_P**: how fast an expert moves host -> GPU over PCIe (pinned, gathered);
- **B_H**: how fast the CPU computes an expert from host RAM (the expert kernel's read rate).

A step with m misses, expert size S: fetching q of them takes q·S/B_P; the CPU computes the other
m - q at the host bandwidth the DMA leaves it, (m - q)·S/(B_H - B_P). Both run at once, and the step
is shortest when they finish together:

    q* = m · B_P / B_H

(S cancels; with B_H <= B_P the CPU can never keep up, so every miss is fetched), rounded and
clamped to [1, min(m, --moe-hybrid-max-fetch)] (at least one fetch keeps the cache learning), and
scaled by the correction `bench bw` measured with both branches running. The `hybrid` backend uses
q*; `offload` is q = m, `cpu` is q = 0. `ft bench bw` prints both bandwidths and the backend they
favour for this machine.
""",
}


def help_topic(
    ctx: typer.Context,
    topic: Annotated[
        str | None, typer.Argument(help=f"One of: {', '.join(TOPICS)}; or a command, as its --help.")
    ] = None,
) -> None:
    """Explain a topic (backends, formats, qstar), or a command: `ft help run` is `ft run --help`."""
    from rich.console import Console
    from rich.markdown import Markdown

    root = ctx.find_root()
    group: Any = root.command
    commands = [name for name in group.list_commands(root) if name != "help"]
    listed = f"topics: {', '.join(TOPICS)}; commands: {', '.join(commands)}"
    if topic is None:
        print(f"{listed} (ft help TOPIC, ft help COMMAND)")
        return
    if topic in commands:  # the same as `ft TOPIC --help`
        group.main([topic, "--help"], prog_name=root.info_name, standalone_mode=False)
        return
    text = TOPICS.get(topic.lower().replace("*", "star").replace("-", ""))
    if text is None:
        raise FreeTokenError(f"no help topic or command {topic!r}; {listed}")
    Console().print(Markdown(text))
