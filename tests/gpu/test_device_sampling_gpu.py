"""Device sampling on CUDA: captured in a CUDA graph with no host sync, and the same draws as on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.device_sampling import SamplingRows, sample_rows
from freetoken.runtime.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
B, V = 6, 152_064  # Qwen3's vocabulary


def params(seed: int) -> list[torch.Tensor]:
    """Row parameters on CUDA: temperature, top_k, top_p, seed, step [B]; rows 0 and 4 greedy."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(B, generator=g) + 0.3
    temperature[0] = 0.0
    top_k = torch.randint(0, 50, (B,), generator=g)
    top_k[4] = 1
    top_p = torch.rand(B, generator=g) * 0.5 + 0.5
    top_p[1] = 1.0
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    step = torch.randint(0, 1000, (B,), generator=g)
    return [t.cuda() for t in (temperature, top_k, top_p, seeds, step)]


def logits(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, V, device="cuda", generator=g) * 4).bfloat16()


def test_replays_in_a_cuda_graph_without_a_host_sync() -> None:
    x, rows = logits(0), params(0)
    updates = [(logits(seed), params(seed)) for seed in (1, 2)]  # made before the sync check
    updates[1][0][5, 17] = float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (sort workspaces) off the capture
        sample_rows(x, *rows)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            tokens, finite = sample_rows(x, *rows)
        for new_logits, new_rows in updates:
            x.copy_(new_logits)  # the graph's inputs change in place
            for buffer, new in zip(rows, new_rows, strict=True):
                buffer.copy_(new)
            graph.replay()
            results.append((tokens.clone(), finite.clone(), *sample_rows(x, *rows)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got_tokens, got_finite, want_tokens, want_finite in results:
        assert torch.equal(got_tokens, want_tokens)
        assert torch.equal(got_finite, want_finite)
    assert results[0][1].tolist() == [True] * B
    assert results[1][1].tolist() == [True] * 5 + [False]
    assert not torch.equal(results[0][0], results[1][0])


def test_the_gpu_draw_equals_the_cpu_draw() -> None:
    x, rows = logits(3), params(3)
    for _ in range(5):
        rows[4].add_(1)  # the next step
        gpu = sample_rows(x, *rows)[0].cpu()
        cpu = sample_rows(x.cpu(), *(t.cpu() for t in rows))[0]
        assert torch.equal(gpu, cpu)


def test_staged_rows_upload_and_sample_without_a_host_sync() -> None:
    x = logits(4)
    x_cpu = x.cpu()  # a device-to-host copy syncs: made before the check
    staged = SamplingRows(max_rows=8, device="cuda")
    cpu = SamplingRows(max_rows=8, device="cpu")
    choices = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(), SamplingParams(temperature=1.1)]
    drawn = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            for i in range(B):
                for rows in (staged, cpu):
                    rows.set_row(i, choices[i % 3], seed=100 + i, step=step)
            staged.upload(B)
            cpu.upload(B)
            drawn.append((staged.sample(x)[0], cpu.sample(x_cpu)[0]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for gpu, cpu_tokens in drawn:
        assert torch.equal(gpu.cpu(), cpu_tokens)
