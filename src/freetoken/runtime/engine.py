"""Engine: build once; `add_request` / `step` / `generate`.

`step` runs one sequence at a time (the server's Batcher runs many, through `decode_batch`); its KV
cache is kept between requests, so a request that extends the previous conversation only prefills
what is new.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from freetoken.errors import FreeTokenError
from freetoken.replay.recorder import RoutingRecorder
from freetoken.replay.trace import DECODE, PREFILL
from freetoken.runtime.anchors import AnchorTable
from freetoken.runtime.config import EngineConfig, MoeConfig, parse_cpu_layers
from freetoken.runtime.devices import resolve_device, resolve_dtype
from freetoken.runtime.kv.cache import KVCache
from freetoken.runtime.kv.state_checkpoints import StateCheckpoints
from freetoken.runtime.loader import WeightSource, load_model
from freetoken.runtime.memory import plan_slots
from freetoken.runtime.moe.counters import MoeCounters
from freetoken.runtime.moe.executor import ExecutorContext, build_executor, resolve_backend
from freetoken.runtime.profile import load_profile, with_profile
from freetoken.runtime.request import Request, accept_token, new_request
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence, TokenEvent
from freetoken.runtime.weights import ProgressFn


class Engine:
    def __init__(
        self, config: EngineConfig, progress: ProgressFn | None = None, weights: WeightSource | None = None
    ) -> None:
        """Build once. `weights` fills the model and returns the expert pool; default: the folder's
        safetensors (a benchmark can pass random weights made in memory)."""
        self.engine_config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config, self.device, self.dtype, progress, weights)
        self.config, self.tokenizer, self.pool = loaded.config, loaded.tokenizer, loaded.pool
        model = loaded.model
        self.moe_counters = MoeCounters(self.config.moe_layers)
        self.model = model
        self.profile = load_profile() if self.config.moe_layers else None  # warns about a foreign one
        self._last_probe = time.monotonic()
        self.configure_moe(config.moe)
        self.model.eval()
        self.max_seq_len = min(
            config.max_seq_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.stop_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.config.eos_token_ids)
        self._sequence: Sequence | None = None
        # built once: every sequence of a hybrid model gets its own store of checkpoints over it
        self._anchors = None if reuses_kv_prefixes(self) else AnchorTable.from_tokenizer(self.tokenizer)
        self._queue: deque[Request] = deque()
        self._next_id = 0
        self.recorder: RoutingRecorder | None = None
        self.heartbeat = time.monotonic()  # when the last forward pass ended: progress, for a watchdog

    def record_routing(self, recorder: RoutingRecorder | None) -> None:
        """Hand every MoE layer's routing to `recorder` (None stops recording)."""
        self.recorder = recorder
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
        if moe.cpu_threads:
            torch.set_num_threads(moe.cpu_threads)  # the host's compute budget, process-wide
        self.num_slots = plan_slots(moe, backend, self.config, self.pool, self.device)
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
        self.moe_counters.reset()

    def close(self) -> None:
        """Stop the executor's worker threads."""
        self.executor.close()

    def reset(self) -> None:
        """Forget the cached sequence (and its checkpoints): the next request prefills its whole prompt."""
        self._sequence = None

    @property
    def checkpoints(self) -> StateCheckpoints | None:
        """The recurrent-state checkpoints over the conversation `step` holds (hybrid models)."""
        return self._sequence.checkpoints if self._sequence is not None else None

    # -- sequences -------------------------------------------------------------------------------------------

    def new_sequence(self) -> Sequence:
        cfg = self.config
        cache_class = getattr(self.model, "cache_class", KVCache)  # hybrid models add recurrent state
        kv = cache_class(
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
            self.max_seq_len,
            layers=getattr(self.model, "attention_layers", None),  # hybrid models: K/V for these only
        )
        if self._anchors is None:
            return Sequence(kv)
        config = self.engine_config
        store = StateCheckpoints(
            self._anchors, config.state_checkpoints, config.checkpoint_policy, config.checkpoint_interval
        )
        return Sequence(kv, checkpoints=store)

    @torch.inference_mode()
    def forward(self, seq: Sequence, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to `seq` and return logits [T, V] (all_logits) or [1, V] for the last position."""
        if seq.kv.length + len(ids) > self.max_seq_len:
            raise FreeTokenError(
                f"sequence of {seq.kv.length + len(ids)} tokens exceeds the context of {self.max_seq_len}"
            )
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.executor.begin_pass(len(ids))
        try:
            logits = self.model(tokens, seq.kv, all_logits=all_logits)
        finally:
            self.executor.end_pass()
            if self.recorder is not None:
                self.recorder.end_pass(len(ids))
        seq.kv.advance(len(ids))
        seq.token_ids.extend(ids)
        self.heartbeat = time.monotonic()
        return logits

    @torch.inference_mode()
    def decode_batch(self, seqs: list[Sequence], ids: list[int]) -> torch.Tensor:
        """One decode step for several sequences at once: ids[i] continues seqs[i] -> logits [B, V]."""
        for seq, token in zip(seqs, ids, strict=True):  # a sequence standing at an anchor saves its states
            length = seq.kv.length
            self._maybe_checkpoint(seq, self._checkpoint_positions(seq, [token], length, length))
        if len(seqs) == 1:
            return self.forward(seqs[0], ids)
        for seq in seqs:
            if seq.kv.length + 1 > self.max_seq_len:
                raise FreeTokenError(
                    f"sequence of {seq.kv.length + 1} tokens exceeds the context of {self.max_seq_len}"
                )
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.executor.begin_pass(1)
        try:
            logits = self.model.decode_batch(tokens, [seq.kv for seq in seqs])
        finally:
            self.executor.end_pass()
            if self.recorder is not None:
                self.recorder.end_pass(len(ids))
        for seq, token in zip(seqs, ids, strict=True):
            seq.kv.advance(1)
            seq.token_ids.append(token)
        self.heartbeat = time.monotonic()
        return logits

    # -- requests --------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        if not prompt_ids:
            raise FreeTokenError("empty prompt")
        if len(prompt_ids) >= self.max_seq_len:
            raise FreeTokenError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {self.max_seq_len}"
            )
        request = new_request(self._next_id, prompt_ids, params, self.tokenizer, self.stop_ids)
        self._next_id += 1
        self._queue.append(request)
        return request.id

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[TokenEvent]:
        """One forward pass for the request at the head of the queue: its prefill, or one decode step."""
        if not self._queue:
            return []
        request = self._queue[0]
        event = self._prefill(request) if request.next_token is None else self._decode(request)
        if event.finished:
            self._queue.popleft()
        self._maybe_probe()
        return [event]

    def _maybe_probe(self) -> None:
        """A safe point (between steps): refresh B_P and B_H now and then, so q* follows contention."""
        if not self.moe.reprofile:
            return
        now = time.monotonic()
        if now - self._last_probe >= self.moe.reprofile_interval_s:
            self.executor.probe()
            self._last_probe = time.monotonic()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[TokenEvent]:
        """Run one request to completion, yielding its tokens as they come; the last event has stats."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while self._queue:
                for event in self.step():
                    if event.request_id == request_id:
                        yield event
                        if event.finished:
                            return
        finally:
            self.abort(request_id)

    def abort(self, request_id: int) -> None:
        """Drop a request (finished or not); the KV it wrote stays reusable as a prefix."""
        self._queue = deque(r for r in self._queue if r.id != request_id)

    def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, **template_kwargs: Any
    ) -> Iterator[TokenEvent]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return self.generate(self.tokenizer.encode(prompt), params)

    # -- internals -------------------------------------------------------------------------------------------

    def _prefill(self, request: Request) -> TokenEvent:
        request.t_start = time.perf_counter()
        seq = self._sequence
        if seq is None:
            seq = self._sequence = self.new_sequence()
        reuse = min(seq.common_prefix(request.prompt_ids), len(request.prompt_ids) - 1)
        store = seq.checkpoints
        if not seq.kv.can_truncate(reuse):  # a recurrent state cannot be rewound: resume from a checkpoint
            saved = store.best(reuse) if store is not None else None
            reuse = 0 if saved is None else saved.position
            if saved is not None:
                seq.kv.restore(saved.position, saved.states)  # type: ignore[attr-defined]
                del seq.token_ids[saved.position :]
        if store is not None:
            store.drop_after(reuse)
        seq.truncate(reuse)
        request.cached_tokens = reuse
        self.routing_context(PREFILL, [request.id])
        logits = self.prefill(seq, request.prompt_ids[reuse:])
        return self._accept(request, request.sampler(logits[-1]), first=True)

    def prefill(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        """Append a prompt in chunks of at most `max_prefill_tokens` (bounding activation memory);
        returns the last position's logits [1, V], the same as one unchunked forward. Checkpoint
        positions inside a chunk are captured by the recurrent layers during it (no extra passes)."""
        chunk = self.engine_config.max_prefill_tokens
        base, end = seq.kv.length, seq.kv.length + len(ids)
        marks = self._checkpoint_positions(seq, ids, base, end)
        logits = None
        for a in range(base, end, chunk):
            b = min(a + chunk, end)
            self._maybe_checkpoint(seq, marks)
            inside = tuple(sorted(p for p in marks if a < p < b))
            if inside:
                seq.kv.capture_at = inside  # type: ignore[attr-defined]
            try:
                logits = self.forward(seq, ids[a - base : b - base])
            finally:
                if inside:
                    seq.kv.capture_at, captured = (), seq.kv.captured  # type: ignore[attr-defined]
                    seq.kv.captured = {}  # type: ignore[attr-defined]
            if inside and seq.checkpoints is not None:
                for p in inside:
                    seq.checkpoints.save(p, marks[p], captured[p], owned=True)
        self._maybe_checkpoint(seq, marks)
        assert logits is not None
        return logits

    def _checkpoint_positions(self, seq: Sequence, ids: list[int], start: int, end: int) -> dict[int, str]:
        store = seq.checkpoints
        if store is None:
            return {}
        offset = max(0, start - store.lookback)  # only the tail: this runs every decode step
        return store.positions([*seq.token_ids[offset:], *ids], start, end, offset)

    def _maybe_checkpoint(self, seq: Sequence, marks: dict[int, str]) -> None:
        """Save the recurrent states when the sequence stands at one of `marks`."""
        position = seq.kv.length
        if position in marks and position > 0 and seq.checkpoints is not None:
            seq.checkpoints.save(position, marks[position], seq.kv.linear)  # type: ignore[attr-defined]

    def _decode(self, request: Request) -> TokenEvent:
        assert self._sequence is not None and request.next_token is not None
        self.routing_context(DECODE, [request.id])
        logits = self.decode_batch([self._sequence], [request.next_token])
        return self._accept(request, request.sampler(logits[-1]), first=False)

    def _accept(self, request: Request, token: int, first: bool) -> TokenEvent:
        room = self._sequence is None or self._sequence.kv.length + 1 < self.max_seq_len
        return accept_token(request, token, first, room)


def build_engine(
    model_path: Path | str,
    device: str = "auto",
    dtype: str = "auto",
    moe_backend: str = "auto",
    progress: Callable[[int, int], None] | None = None,
    max_prefill_tokens: int = 8192,
    **moe_options: Any,
) -> Engine:
    """Build an engine; `moe_options` are MoeConfig fields (cache_size, cache_ratio, cpu_layers, ...)."""
    moe = MoeConfig(backend=moe_backend, **moe_options)
    config = EngineConfig(Path(model_path), device, dtype, moe, max_prefill_tokens=max_prefill_tokens)
    return Engine(config, progress)


def reuses_kv_prefixes(engine: Engine) -> bool:
    """Whether K/V alone resumes a sequence (no recurrent layers), so a prefix cache of K/V is enough."""
    return getattr(engine.model, "cache_class", KVCache) is KVCache
