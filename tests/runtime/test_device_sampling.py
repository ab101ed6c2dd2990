"""Device sampling: greedy rows, the counter-based noise, the filtered distribution, the staged rows."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.device_sampling import (
    SamplingRows,
    greedy_rows,
    greedy_rows_reference,
    mix64,
    request_seed,
    sample_rows,
)
from freetoken.runtime.moe.kernels.loader import load_library
from freetoken.runtime.sampling import Sampler, SamplingParams

M64 = (1 << 64) - 1


def splitmix64_finaliser(z: int) -> int:
    """The reference on Python's unbounded ints (unsigned 64-bit)."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


@pytest.mark.skipif(load_library() is None, reason="needs the compiled CPU kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_greedy_rows_match_torch_ties_nan_and_inf_included(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[1, 10] = logits[1, 700] = 50.0  # a tie: the first index wins
    logits[2, 5], logits[2, 9] = float("nan"), float("nan")  # argmax ranks NaN first; not finite
    logits[3, 400] = float("inf")
    logits[4, 3] = float("-inf")
    logits[5] = 0.5  # all equal
    ids, finite = greedy_rows(logits)
    want_ids, want_finite = greedy_rows_reference(logits)
    assert ids.tolist() == want_ids.tolist() == [int(want_ids[0]), 10, 5, 400, int(want_ids[4]), 0]
    assert finite.tolist() == want_finite.tolist() == [True, True, False, False, False, True]


def rows(
    b: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, step: int = 0
) -> tuple[torch.Tensor, ...]:
    """[B] parameter tensors, every row alike."""
    return (
        torch.full((b,), temperature, dtype=torch.float32),
        torch.full((b,), top_k, dtype=torch.int64),
        torch.full((b,), top_p, dtype=torch.float32),
        torch.full((b,), seed, dtype=torch.int64),
        torch.full((b,), step, dtype=torch.int64),
    )


def test_the_hash_is_splitmix64_on_int64_bits() -> None:
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x123456789ABCDEF, -987654321987654321]
    got = mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & M64 for g in got] == [splitmix64_finaliser(v) for v in values]


def test_greedy_rows_are_argmax_ties_included() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (6, 40), generator=g).float()  # many ties at the max
    want = torch.argmax(x, dim=-1)
    tokens, finite = greedy_rows(x)
    assert torch.equal(tokens, want) and bool(finite.all())
    temperature, top_k, top_p, seed, step = rows(6, temperature=0.7)
    temperature[:3] = 0.0  # greedy by temperature
    top_k[3:] = 1  # greedy by top_k
    assert torch.equal(sample_rows(x, temperature, top_k, top_p, seed, step)[0], want)
    bf16 = (torch.randn(4, 64, generator=g) * 3).bfloat16()
    assert torch.equal(sample_rows(bf16, *rows(4, temperature=0.0))[0], torch.argmax(bf16.float(), dim=-1))


def test_a_seeded_row_is_independent_of_its_batch() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, generator=g) * 2
    others = torch.randn(5, 100, generator=g) * 3
    for step in range(40):
        alone = sample_rows(x[None], *rows(1, 0.9, 20, 0.95, seed=1234, step=step))[0]
        batch = others.clone()
        batch[3] = x
        temperature, top_k, top_p, seed, steps = rows(5, 1.5, 0, 0.7, seed=99, step=step + 7)
        temperature[0] = 0.0
        temperature[3], top_k[3], top_p[3], seed[3], steps[3] = 0.9, 20, 0.95, 1234, step
        together = sample_rows(batch, temperature, top_k, top_p, seed, steps)[0]
        assert int(together[3]) == int(alone[0])


def test_seed_and_step_pick_the_noise() -> None:
    x = torch.zeros(1000)  # uniform: the noise alone decides
    draw = [int(sample_rows(x[None], *rows(1, seed=s, step=t))[0]) for s in (5, 6) for t in (0, 1, 0)]
    assert draw[0] == draw[2] and draw[3] == draw[5]
    assert len({draw[0], draw[1], draw[3], draw[4]}) > 2


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.5), (1.3, 3, 0.8), (2.0, 5, 0.9), (1.0, 2, 0.5)],
)
def test_draws_follow_the_reference_distribution(temperature: float, top_k: int, top_p: float) -> None:
    x = torch.tensor([1.0, 0.2, 0.9, -0.5, 0.5, 0.0, -1.5, 0.4])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    want = Sampler(params).filtered_probs(x)
    n = 4000
    temps, ks, ps, seeds, _ = rows(n, temperature, top_k, top_p, seed=2024)
    tokens, finite = sample_rows(x.expand(n, -1), temps, ks, ps, seeds, torch.arange(n))
    assert bool(finite.all())
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert float((freq - want).abs().max()) < 0.03, (freq, want)
    assert not bool(freq[want == 0].any())  # filtered tokens never appear


def test_ties_at_the_kth_value_stay_like_the_reference() -> None:
    x = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0, -1.0])
    want = Sampler(SamplingParams(temperature=1.0, top_k=2)).filtered_probs(x)
    assert int((want > 0).sum()) == 4
    tokens, _ = sample_rows(x.expand(3000, -1), *rows(3000, top_k=2, seed=3)[:4], torch.arange(3000))
    freq = torch.bincount(tokens, minlength=6).float() / 3000
    assert float((freq - want).abs().max()) < 0.03 and not bool(freq[4:].any())


def test_non_finite_rows_are_reported() -> None:
    x = torch.randn(4, 30)
    x[1, 5], x[2, 0], x[3, 29] = float("nan"), float("inf"), float("-inf")
    for temperature in (0.0, 1.0):
        tokens, finite = sample_rows(x, *rows(4, temperature, 5, 0.9))
        assert finite.tolist() == [True, False, False, False]
        assert tokens.shape == (4,) and bool(((tokens >= 0) & (tokens < 30)).all())
    assert greedy_rows(x)[1].tolist() == [True, False, False, False]


def test_fixed_shapes_and_no_host_reads() -> None:
    """On the meta device any data-dependent shape or host read (.item, nonzero, masks) would fail."""
    b, v = 3, 152_000
    x = torch.empty(b, v, dtype=torch.bfloat16, device="meta")
    params = [t.to("meta") for t in rows(b)]
    tokens, finite = sample_rows(x, *params)
    assert tokens.shape == (b,) and tokens.dtype == torch.int64 and finite.dtype == torch.bool


def test_the_sampler_draws_with_sample_rows_step_by_step() -> None:
    x = torch.randn(50, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=77)
    sampler = Sampler(params)
    assert (sampler.seed, sampler.step) == (77, 0)
    drawn = [sampler(x) for _ in range(25)]
    assert sampler.step == 25
    temps, ks, ps, seeds, _ = rows(25, 0.8, 10, 0.9, seed=77)
    assert sample_rows(x.expand(25, -1), temps, ks, ps, seeds, torch.arange(25))[0].tolist() == drawn


def test_request_seed() -> None:
    assert request_seed(SamplingParams(seed=5)) == 5
    assert request_seed(SamplingParams(seed=2**64 - 1)) == -1  # the same 64 bits as an int64
    assert request_seed(SamplingParams(seed=-(2**63))) == -(2**63)
    fresh = {request_seed(SamplingParams()) for _ in range(4)}
    assert len(fresh) == 4 and all(0 <= s < 2**63 for s in fresh)


def test_record_matches_a_call() -> None:
    """A batched device draw followed by record() leaves the sampler where __call__ would have."""
    params = SamplingParams(temperature=1.0, seed=8, frequency_penalty=0.5, presence_penalty=0.3)
    x = torch.randn(20, generator=torch.Generator().manual_seed(2))
    called, recorded = Sampler(params), Sampler(params)
    for _ in range(6):
        token = called(x)
        recorded.record(token)
        assert recorded.step == called.step
        assert torch.equal(recorded.adjusted(x), called.adjusted(x))


def test_sampling_rows_stage_requests_from_their_samplers() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 64, generator=g) * 2
    samplers = [
        Sampler(SamplingParams(temperature=0.9, top_p=0.8, seed=1)),
        Sampler(SamplingParams()),  # greedy
        Sampler(SamplingParams(temperature=1.2, top_k=7, seed=2)),
        Sampler(SamplingParams(temperature=0.5, seed=3)),
    ]
    reference = [Sampler(s.params) for s in samplers]
    staged = SamplingRows(max_rows=6, device="cpu")
    for step in range(12):
        n = 4 if step < 6 else 3  # the last request leaves half-way
        for i, sampler in enumerate(samplers[:n]):
            staged.set_row(i, sampler.params, sampler.seed, sampler.step)
        staged.upload(n)
        assert not staged.all_greedy(n) and staged.all_greedy(2) is False
        tokens, finite = staged.sample(x[:n])
        assert bool(finite.all())
        for i, token in enumerate(tokens.tolist()):
            samplers[i].record(token)
            assert token == reference[i](x[i])  # the same draw as the host path, same (seed, step)


def test_sampling_rows_keep_rows_not_restaged() -> None:
    staged = SamplingRows(max_rows=3, device="cpu")
    staged.set_row(0, SamplingParams(temperature=0.7, top_k=4, top_p=0.6), seed=11, step=2)
    staged.set_row(1, SamplingParams(), seed=12, step=0)
    staged.upload(2)
    assert not staged.all_greedy(2) and staged.all_greedy(1) is False
    staged.set_row(1, SamplingParams(temperature=1.0), seed=12, step=1)  # the other staging copy now
    staged.upload(2)
    torch.testing.assert_close(staged.temperature[:2], torch.tensor([0.7, 1.0]))
    assert staged.top_k[:2].tolist() == [4, 0] and staged.seed[:2].tolist() == [11, 12]
    assert staged.step[:2].tolist() == [2, 1]
    torch.testing.assert_close(staged.top_p[:2], torch.tensor([0.6, 1.0]))
    greedy = SamplingRows(max_rows=2, device="cpu")
    greedy.set_row(0, SamplingParams(temperature=1.0, top_k=1), seed=0, step=0)
    greedy.set_row(1, SamplingParams(), seed=0, step=0)
    assert greedy.all_greedy(2)


def test_skipping_the_filters_draws_the_same_tokens_when_no_row_has_one() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=g) * 3
    temperature = torch.tensor([0.7, 1.0, 1.6, 0.0])
    top_k, top_p = torch.zeros(4, dtype=torch.int64), torch.ones(4)
    seed = torch.tensor([1, 2, 3, 4])
    for step in range(20):
        steps = torch.full((4,), step)
        full = sample_rows(logits, temperature, top_k, top_p, seed, steps)
        plain = sample_rows(logits, temperature, top_k, top_p, seed, steps, filters=False)
        assert torch.equal(full[0], plain[0]) and torch.equal(full[1], plain[1])
