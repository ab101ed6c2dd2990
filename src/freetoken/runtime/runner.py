"""The passes over the model that the scheduler drives: a prompt's prefill (in chunks, recurrent states
saved at anchors), a forward pass, and one decode step over the static KV pool (the model's own step, a
CUDA graph replay where it can be) with its draw. The engine (engine.py) builds it and keeps the model's
memory and the expert executor; this runs steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from freetoken.errors import FreeTokenError
from freetoken.runtime.config import EngineConfig
from freetoken.runtime.decode_graph import MAX_ROWS, SlotDecoder, StepOutput, padded_size
from freetoken.runtime.moe.executor import ExpertExecutor
from freetoken.runtime.request import Request, Sampled, sample
from freetoken.runtime.request_decode import accept_drawn, sampling_mode, stage_sampling
from freetoken.runtime.sampling import NonFiniteLogits
from freetoken.runtime.sequence import Sequence

if TYPE_CHECKING:
    from freetoken.replay.recorder import RoutingRecorder


class StepRunner:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        device: torch.device,
        decoder: SlotDecoder,
        max_seq_len: int,
    ) -> None:
        self.model, self.config, self.device, self.decoder = model, config, device, decoder
        self.max_seq_len = max_seq_len
        self.executor: ExpertExecutor | None = None  # the engine's, handed over whenever it builds one
        self.recorder: RoutingRecorder | None = None
        self.heartbeat = time.monotonic()  # when the last forward pass ended: progress, for a watchdog

    @contextmanager
    def pass_scope(self, new_tokens: int, rows: int) -> Iterator[None]:
        """Around one forward pass of `new_tokens` per sequence over `rows` token rows: the executor's
        begin/end (also when the pass raises) and the routing recorder's end of pass."""
        executor = self.executor
        assert executor is not None, "the engine hands its expert executor over before any pass"
        executor.begin_pass(new_tokens, rows)
        try:
            yield
        finally:
            executor.end_pass()
            if self.recorder is not None:
                self.recorder.end_pass(rows)

    @torch.inference_mode()
    def forward(self, seq: Sequence, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append `ids` to `seq` and return logits [T, V] (all_logits) or [1, V] for the last position."""
        self._check_room(seq, len(ids))
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        with self.pass_scope(len(ids), len(ids)):
            logits = self.model(tokens, seq.kv, all_logits=all_logits)
        seq.kv.advance(len(ids))
        seq.token_ids.extend(ids)
        self.heartbeat = time.monotonic()
        return logits

    @torch.inference_mode()
    def decode_batch(self, seqs: list[Sequence], ids: list[int]) -> torch.Tensor:
        """One decode step for several sequences at once: ids[i] continues seqs[i] -> logits [B, V] (the
        step decode_tokens runs, in parts of at most MAX_ROWS rows, returning its logits)."""
        return torch.cat(
            [
                self.slot_step(seqs[a : a + MAX_ROWS], ids[a : a + MAX_ROWS], "logits").logits.clone()
                for a in range(0, len(seqs), MAX_ROWS)
            ]
        )

    def decode_tokens(self, requests: list[Request]) -> list[Sampled | Exception]:
        """One decode step for running requests (each one's next token fed, the one after it drawn); a row
        whose sampling failed is its exception, so that request fails alone. Over the static KV pool the
        draw happens inside the step (a graph replay on CUDA), in parts of at most MAX_ROWS rows."""
        results: list[Sampled | Exception] = []
        for a in range(0, len(requests), MAX_ROWS):
            part = requests[a : a + MAX_ROWS]
            mode = sampling_mode(part)
            if mode in ("sample", "draw"):
                stage_sampling(self.decoder.sampling, part)
            seqs = [request.seq for request in part]
            out = self.slot_step(seqs, [request.next_token for request in part], mode)  # type: ignore[arg-type,misc]
            results += [self._named(r) for r in accept_drawn(part, out)]
        return results

    @torch.inference_mode()
    def slot_step(self, seqs: list[Sequence], ids: list[int], mode: str) -> StepOutput:
        """One decode step over the static KV pool for at most MAX_ROWS sequences."""
        for seq in seqs:
            self._check_room(seq, 1)
        self._checkpoint_before_decode(seqs, ids)
        assert self.executor is not None
        eager = self.executor.graph_blocker(padded_size(len(ids)))
        if eager is None and self.recorder is not None:
            eager = "routing is being recorded"
        with self.pass_scope(1, len(ids)):
            out = self.decoder.step(ids, [s.kv.length for s in seqs], [s.kv.slot for s in seqs], mode, eager)
        for seq, token in zip(seqs, ids, strict=True):
            seq.kv.advance(1)
            seq.token_ids.append(token)
        self.heartbeat = time.monotonic()
        return out

    def _check_room(self, seq: Sequence, new_tokens: int) -> None:
        if seq.kv.length + new_tokens > self.max_seq_len:
            raise FreeTokenError(
                f"sequence of {seq.kv.length + new_tokens} tokens exceeds the context of {self.max_seq_len}"
            )

    def sample_first(self, request: Request, logits: torch.Tensor) -> Sampled:
        """The first token of a request, from its prefill's last-position logits [V]."""
        try:
            return sample(request, logits)
        except NonFiniteLogits as exc:
            raise self._named(exc) from None

    def _named(self, result: Any) -> Any:
        """A NaN/Inf failure says which model produced it (the message reaches users as one line)."""
        if isinstance(result, NonFiniteLogits):
            return NonFiniteLogits(f"{self.config.model_path}: {result}")
        return result

    def prefill(self, seq: Sequence, ids: list[int]) -> torch.Tensor:
        """Append a prompt in chunks of at most `max_prefill_tokens` (bounding activation memory);
        returns the last position's logits [1, V], the same as one unchunked forward. Checkpoint
        positions inside a chunk are captured by the recurrent layers during it (no extra passes)."""
        chunk = self.config.max_prefill_tokens
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

    def _checkpoint_before_decode(self, seqs: list[Sequence], ids: list[int]) -> None:
        """A sequence standing at an anchor saves its recurrent states before the step moves them on."""
        for seq, token in zip(seqs, ids, strict=True):
            length = seq.kv.length
            self._maybe_checkpoint(seq, self._checkpoint_positions(seq, [token], length, length))

    def _maybe_checkpoint(self, seq: Sequence, marks: dict[int, str]) -> None:
        """Save the recurrent states when the sequence stands at one of `marks`."""
        position = seq.kv.length
        if position in marks and position > 0 and seq.checkpoints is not None:
            seq.checkpoints.save(position, marks[position], seq.kv.linear)  # type: ignore[attr-defined]
