"""Engine: build once; `add_request` / `step` / `generate`.

The verbs go through the one scheduler (runtime/scheduler.py) as a batch of one; `serve` runs the same
scheduler with many. A finished request's KV (and, on a hybrid model, its recurrent-state checkpoints)
goes into the scheduler's prefix cache, so a request that extends the previous conversation only
prefills what is new. The engine is the facade: it builds the model, the KV pool and the expert executor,
splits the device memory between them (and re-splits it at safe points), and answers the scheduler's
passes — `prefill`, `decode_tokens` (one batched decode step and its sampling), `sample_first` — through
its StepRunner (runner.py), which runs them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from freetoken.runtime.config import DEFAULT_CONTEXT, EngineConfig, MoeConfig, parse_cpu_layers
from freetoken.runtime.decode_graph import MAX_ROWS, SlotDecoder
from freetoken.runtime.device_sampling import SamplingRows
from freetoken.runtime.devices import resolve_device
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.prefix_cache import PrefixCache
from freetoken.runtime.kv.slot_pool import KVSlotPool
from freetoken.runtime.kv.state_checkpoints import Checkpoint, StateCheckpoints
from freetoken.runtime.loading.loader import WeightSource, load_model
from freetoken.runtime.loading.weights import ProgressFn
from freetoken.runtime.measure.cpu_share import CpuThreads, clamp_threads
from freetoken.runtime.measure.profile import load_profile, with_profile
from freetoken.runtime.memory import (
    held_bytes,
    kv_bytes_per_token,
    plan_slots,
    probe_slot_bytes,
    slot_ceiling,
)
from freetoken.runtime.moe.counters import MoeCounters
from freetoken.runtime.moe.executor import ExecutorContext, build_executor, resolve_backend
from freetoken.runtime.request import Request, Sampled
from freetoken.runtime.runner import StepRunner
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from freetoken.runtime.sequence import Sequence, TokenEvent
from freetoken.runtime.text.anchors import AnchorTable

if TYPE_CHECKING:
    from freetoken.replay.recorder import RoutingRecorder

log = logging.getLogger("freetoken.engine")


class Engine:
    def __init__(
        self, config: EngineConfig, progress: ProgressFn | None = None, weights: WeightSource | None = None
    ) -> None:
        """Build once. `weights` fills the model and returns the expert pool; default: the folder's
        safetensors (a benchmark can pass random weights made in memory)."""
        self.engine_config = config
        self.device = resolve_device(config.device)
        loaded = load_model(config, self.device, progress, weights)
        self.dtype = loaded.dtype
        self.config, self.tokenizer, self.pool = loaded.config, loaded.tokenizer, loaded.pool
        model = loaded.model
        self.moe_counters = MoeCounters(self.config.moe_layers)
        self.model = model
        self.profile = load_profile() if self.config.moe_layers else None  # warns about a foreign one
        self._last_probe = time.monotonic()
        self.max_seq_len = min(config.max_seq_len or DEFAULT_CONTEXT, self.config.max_position_embeddings)
        # before the expert slots are sized: the K/V of every running sequence is held from the start
        self.kv_pool = self._make_kv_pool(config.max_running)
        self._kv_generation = self.kv_pool.generation
        self.resplits = 0  # times the device memory was re-split between the KV pool and the slots
        # decode over the static KV pool: every model owns its step (CUDA graphs on a GPU)
        model.prepare_decode()
        decoder = SlotDecoder(model, self.kv_pool, self.device, SamplingRows(MAX_ROWS, self.device))
        self.runner = StepRunner(model, config, self.device, decoder, self.max_seq_len)
        self.configure_moe(config.moe)
        self.model.eval()
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        # built once: every sequence of a hybrid model gets its own store of checkpoints over it
        hybrid = not reuses_kv_prefixes(self)
        self._anchors = AnchorTable.from_tokenizer(self.tokenizer) if hybrid else None
        # What a conversation leaves for its next turn (`run` and the verbs; `serve` sizes its own): one
        # full context of K/V, what the single sequence the engine used to keep could hold, and on a hybrid
        # model one conversation's checkpoints (its anchors and its end). Only computed tokens are stored.
        prefix = PrefixCache(self.max_seq_len, config.state_checkpoints + 1 if hybrid else 0)
        self.scheduler = Scheduler(self, prefix, max_running=1)
        self._events: list[TokenEvent | Exception] = []  # delivered by the scheduler, returned by step

    @property
    def decoder(self) -> SlotDecoder:
        """The decode step over the static KV pool (CUDA graphs there), the runner's."""
        return self.runner.decoder

    @property
    def recorder(self) -> RoutingRecorder | None:
        return self.runner.recorder

    def record_routing(self, recorder: RoutingRecorder | None) -> None:
        """Hand every MoE layer's routing to `recorder` (None stops recording)."""
        self.runner.recorder = recorder
        for block in self.model.moe_blocks():
            block.recorder = recorder

    def routing_context(self, phase: int, request_ids: list[int]) -> None:
        """What the next passes' rows are (for the routing recorder, when one is on)."""
        if self.recorder is not None:
            self.recorder.context(phase, request_ids)

    def configure_moe(self, moe: MoeConfig) -> None:
        """(Re)build the expert executor for `moe`; the pool stays, so only speed changes.

        Call between requests: the old executor's slots are released before the new ones are taken.
        """
        profile = self.profile
        moe = with_profile(moe, profile)
        recommended = profile.recommended_backend if profile is not None else None
        backend = resolve_backend(moe, self.device, bool(self.config.moe_layers), recommended)
        cpu_layers = parse_cpu_layers(moe.cpu_layers, self.config.moe_layers)
        old = getattr(self, "executor", None)
        if old is not None:
            old.close()
            self.model.attach_executor(None)  # the blocks hold it too: let its device memory go
            del old
            self.executor = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        # the host's compute budget, process-wide: at most the allowed cores, fewer while others use some
        self.cpu_threads = CpuThreads(clamp_threads(moe.cpu_threads))
        self._slot_ceiling = slot_ceiling(moe, backend, self.config, self.pool, self.device)
        self.num_slots = self._plan_slots(moe, backend)
        ctx = ExecutorContext(
            pool=self.pool,
            device=self.device,
            moe=moe,
            num_slots=self.num_slots,
            num_experts_per_tok=self.config.num_experts_per_tok,
            cpu_layers=cpu_layers,
            counters=self.moe_counters,
        )
        self.moe = moe
        self.backend = backend
        self.executor = build_executor(backend, ctx)
        self.model.attach_executor(self.executor)
        self.runner.executor = self.executor
        self.decoder.attach(self.executor)
        if self.decoder.native is not None:
            log.info("decode steps on the CPU run as one native call each")
        elif self.device.type == "cpu":
            why = self.decoder.native_off
            log.info("decode steps on the CPU run through the model's own decode: %s", why)
        self.moe_counters.reset()

    def close(self) -> None:
        """Stop the executor's threads; drop the scheduler (it points back here), so the pool and model
        go when the caller drops the engine, not at the next full gc pass. Takes no request after."""
        self.executor.close()
        self.__dict__.pop("scheduler", None)

    def reset(self) -> None:
        """Forget cached conversations (K/V and checkpoints): the next request prefills its whole prompt."""
        self.scheduler.prefix.clear()

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The recurrent-state checkpoints the scheduler's prefix cache holds (hybrid models; else none)."""
        return self.scheduler.prefix.saved_checkpoints()

    # -- sequences -------------------------------------------------------------------------------------------

    def reserve_slots(self, slots: int) -> None:
        """Make the static KV cache hold `slots` sequences at once (a scheduler asks before it runs)."""
        self.kv_pool.grow(slots)
        if self.kv_pool.generation != self._kv_generation:
            self._kv_generation = self.kv_pool.generation
            self._resplit()

    # -- device memory: the KV pool and the expert slots under --vram-budget -------------------------------

    def set_vram_budget(self, budget: str | None) -> None:
        """At a safe point (between scheduler turns): cap the engine's device memory at `budget` (GiB or a
        share of the device, as --vram-budget; None: no cap) and re-split it: the expert slots shrink to
        what the weights and the KV pool leave (the least recently used experts leave) or grow back."""
        self.moe = self.executor.ctx.moe = replace(self.moe, vram_budget=budget)
        self._resplit()

    def _held_bytes(self, moe: MoeConfig, backend: str) -> int:
        probe = probe_slot_bytes(backend, self.pool)
        return held_bytes(self.model, self.kv_pool.nbytes, moe, self.config, self.device, probe)

    def _plan_slots(self, moe: MoeConfig, backend: str) -> int:
        """Expert slots in what the device has left beside the weights, the KV pool and the probe slot."""
        held = self._held_bytes(moe, backend)
        return plan_slots(moe, backend, self.config, self.pool, self._slot_ceiling, held, self.device)

    def _resplit(self) -> None:
        if self._slot_ceiling == 0:
            return
        slots = self._plan_slots(self.moe, self.backend)
        if slots == self.num_slots:
            return
        log.info("expert slots re-split: %d -> %d", self.num_slots, slots)
        self.decoder.reset()  # the graphs hold the old banks and tables
        self.executor.resize_slots(slots)
        self.num_slots = slots
        self.resplits += 1

    def memory_report(self) -> dict[str, Any]:
        """The device memory split: expert slots, the KV pool, the budget and how often it was re-split."""
        expert = self.pool.expert_nbytes if self.pool is not None else 0
        return {
            "vram_budget": self.moe.vram_budget,
            # weights, KV pool, the probe slot (and margin on CUDA): not the cache's slots
            "held_bytes": self._held_bytes(self.moe, self.backend),
            "expert_slots": self.num_slots,
            "expert_slot_bytes": self.num_slots * expert,
            "kv_sequences": self.kv_pool.slots,
            "kv_capacity_tokens": self.kv_pool.slots * self.kv_pool.capacity,
            "kv_bytes": self.kv_pool.nbytes,
            # per position over every layer: as cached, and as keys and values per head would be (latent
            # attention caches one latent and its rope key instead)
            "kv_bytes_per_token": kv_bytes_per_token(self.config, self.dtype),
            "kv_bytes_per_token_expanded": kv_bytes_per_token(self.config, self.dtype, expanded=True),
            "resplits": self.resplits,
        }

    def _make_kv_pool(self, slots: int) -> KVSlotPool:
        cfg = self.config
        states = self.model.state_shapes(self.dtype)  # hybrid models: recurrent states in slots too
        heads, k_dim, v_dim = cfg.kv_dims
        return KVSlotPool(
            slots, self.model.attention_layers, heads, k_dim, self.max_seq_len, self.dtype, self.device,
            states, v_dim,
        )  # fmt: skip

    def new_sequence(self) -> Sequence:
        cfg = self.config
        kv = self.model.cache_class(  # hybrid models add recurrent state
            cfg.num_layers,
            cfg.kv_dims[0],
            cfg.kv_dims[1],
            self.dtype,
            self.device,
            self.max_seq_len,
            layers=self.kv_pool.layers,  # hybrid models: K/V for their attention layers only
            pool=self.kv_pool,
        )
        if self.kv_pool.generation != self._kv_generation:  # the pool grew for it: the slots make room
            self._kv_generation = self.kv_pool.generation
            self._resplit()
        if self._anchors is None:
            return Sequence(kv)
        config = self.engine_config
        store = StateCheckpoints(
            self._anchors, config.state_checkpoints, config.checkpoint_policy, config.checkpoint_interval
        )
        return Sequence(kv, checkpoints=store)

    # -- passes (runner.py runs them; the scheduler calls them here) -----------------------------------------

    def forward(self, seq: Sequence, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to `seq` and return logits [T, V] (all_logits) or [1, V] for the last position."""
        return self.runner.forward(seq, ids, all_logits)

    def prefill(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        """Append a prompt in chunks (runner.py); the last position's logits [1, V]."""
        return self.runner.prefill(seq, ids)

    def decode_batch(self, seqs: list[Sequence], ids: list[int]) -> torch.Tensor:
        """One decode step for several sequences at once: ids[i] continues seqs[i] -> logits [B, V]."""
        return self.runner.decode_batch(seqs, ids)

    def decode_tokens(self, requests: list[Request]) -> list[Sampled | Exception]:
        """One decode step for running requests, the next token of each drawn (runner.py)."""
        return self.runner.decode_tokens(requests)

    def sample_first(self, request: Request, logits: torch.Tensor) -> Sampled:
        """The first token of a request, from its prefill's last-position logits [V]."""
        return self.runner.sample_first(request, logits)

    @property
    def heartbeat(self) -> float:
        """When the last forward pass ended: progress, for a watchdog."""
        return self.runner.heartbeat

    # -- requests: the three verbs, through the scheduler ----------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        return self.scheduler.add(prompt_ids, params, lambda event: self._events.append(event)).id

    def has_work(self) -> bool:
        return bool(self._events) or self.scheduler.has_work()

    def step(self) -> list[TokenEvent]:
        """One scheduler turn (admit and prefill, then one decode step for the running request); the events
        it produced. A request that failed raises its error here (the turn's other events come next step)."""
        if not self._events:
            self.scheduler.step()
        events, self._events = self._events, []
        failure = next((e for e in events if isinstance(e, Exception)), None)
        if failure is not None:
            self._events = [e for e in events if e is not failure]
            raise failure
        return events  # type: ignore[return-value]

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Run one request to completion, yielding its tokens as they come; the last event has stats."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while self.has_work():
                for event in self.step():
                    if event.request_id == request_id:
                        yield event
                        if event.finished:
                            return
        finally:
            self.abort(request_id)

    def abort(self, request_id: int) -> None:
        """Drop a request (finished or not); the KV it wrote stays reusable as a prefix."""
        self.scheduler.abort(request_id)

    def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> Iterator[TokenEvent]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return self.generate(self.tokenizer.encode(prompt), params)

    def maybe_probe(self) -> None:
        """A safe point (between turns): the CPU threads follow the cores other processes leave; B_P and
        B_H are refreshed now and then, so q* follows contention."""
        threads = self.cpu_threads.poll() if self.moe.share_cores else None
        if threads is not None:
            log.info("CPU threads follow the free cores: %d", threads)
            self.executor.set_cpu_threads(threads)
            self.decoder.follow_host_threads(self.executor.host_threads())
        if not self.moe.reprofile:
            return
        now = time.monotonic()
        if now - self._last_probe >= self.moe.reprofile_interval_s:
            self.executor.probe()
            self._last_probe = time.monotonic()


def build_engine(
    model_path: Path | str,
    device: str = "auto",
    dtype: str = "auto",
    moe_backend: str = "auto",
    progress: Callable[[int, int], None] | None = None,
    max_prefill_tokens: int = 8192,
    max_seq_len: int | None = None,
    **moe_options: Any,
) -> Engine:
    """Build an engine. `model_path`: a model folder, FTW folder or .gguf file, or what `ft run` takes as
    MODEL ('demo', a repo id in the local Hugging Face cache); `moe_options` are MoeConfig fields
    (cache_size, cache_ratio, cpu_layers, ...)."""
    path = Path(model_path)
    if isinstance(model_path, str) and not path.exists():
        from freetoken.runtime.loading.model_ref import resolve_model

        path = resolve_model(model_path)
    moe = MoeConfig(backend=moe_backend, **moe_options)
    config = EngineConfig(
        path, device, dtype, moe, max_seq_len=max_seq_len, max_prefill_tokens=max_prefill_tokens
    )
    return Engine(config, progress)


def reuses_kv_prefixes(engine: Engine) -> bool:
    """Whether K/V alone resumes a sequence (no recurrent layers), so a prefix cache of K/V is enough."""
    return engine.model.cache_class is KVCache
