"""A Qwen3.5/3.6-MoE GGUF as llama.cpp's converter writes it (`qwen35moe`: norms as 1 + w, −exp(A_log),
value heads tiled) gives transformers' logits and greedy tokens under every backend, its experts kept
in their stored codec; so does a Qwen3-Next one (`qwen3next`: in_proj_qkvz in two halves)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.formats.gguf_checkpoint import GgufCheckpoint
from freetoken.formats.gguf_meta import build_tokenizer, config_dict
from freetoken.runtime.engine import build_engine
from freetoken.runtime.sampling import SamplingParams
from gguf_fixture import ftw_logits_match
from gguf_qwen35_fixture import write_qwen35_gguf
from oracle import HYBRID_BACKEND_CASES, build_hybrid_model, build_qwen3_next_model, rel_err

PROMPT = [5, 77, 301, 12, 9, 250, 33, 401]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, Path]:
    folder = tmp_path_factory.mktemp("qwen35")
    hf = build_hybrid_model(folder)
    return folder, hf, write_qwen35_gguf(hf, folder, folder / "q35.gguf")


def test_the_file_reads_back_into_transformers_names_and_values(qwen35: tuple[Path, object, Path]) -> None:
    _, hf, path = qwen35
    state = hf.state_dict()  # type: ignore[attr-defined]
    with GgufCheckpoint(path) as ckpt:
        for name in ckpt.names():
            if ".mlp.experts." in name:
                continue
            got, want = ckpt.read(name).float(), state[name].float()
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("backend", "options"), HYBRID_BACKEND_CASES)
def test_logits_and_tokens_equal_transformers(
    qwen35: tuple[Path, object, Path], backend: str, options: dict[str, object]
) -> None:
    _, hf, path = qwen35
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend=backend, **options)
    assert engine.config.architecture == "qwen3_5_moe_text"
    assert engine.config.raw["layer_types"] == list(hf.config.layer_types)  # type: ignore[attr-defined]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]  # type: ignore[operator]
    ours = engine.forward(engine.new_sequence(), PROMPT, all_logits=True)
    assert rel_err(ours, want) < 1e-4
    engine.reset()
    got = [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, len(PROMPT) :].tolist()  # type: ignore[attr-defined]
    assert got == ref
    engine.close()


def test_quantized_experts_stay_as_stored(qwen35: tuple[Path, object, Path], tmp_path: Path) -> None:
    folder, hf, _ = qwen35
    path = write_qwen35_gguf(hf, folder, tmp_path / "q35-q4k.gguf", expert_types=("Q8_0", "MXFP4"))
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    assert sorted(engine.pool.describe()["dtypes"]) == ["MXFP4", "Q8_0"]
    assert len([e for e in engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))]) == 4
    engine.close()


def test_layer_kinds_listed_per_layer_read_as_the_interval_does(
    qwen35: tuple[Path, object, Path], tmp_path: Path
) -> None:
    folder, hf, _ = qwen35
    path = write_qwen35_gguf(hf, folder, tmp_path / "listed.gguf", recurrent_layers=True)
    with GgufCheckpoint(path) as ckpt:
        assert config_dict(ckpt)["layer_types"] == list(hf.config.layer_types)  # type: ignore[attr-defined]


def test_the_qwen35_pre_tokenizer_keeps_combining_marks_in_words(qwen35: tuple[Path, object, Path]) -> None:
    with GgufCheckpoint(qwen35[2]) as ckpt:
        tokenizer, _ = build_tokenizer(ckpt)
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("cafe\u0301s 12")]
    assert (
        len(pieces) == 4
    )  # "café s" one word (its mark inside), " ", "1", "2" (Qwen2's splits the mark off)


def test_the_gguf_converts_to_ftw_and_matches(qwen35: tuple[Path, object, Path], tmp_path: Path) -> None:
    assert ftw_logits_match(qwen35[2], tmp_path / "ftw", PROMPT)


def test_qwen3_next_with_a_dense_layer_gives_transformers_tokens(tmp_path: Path) -> None:
    """qwen3next: the fused in_proj_qkvz joined back from the file's two halves; its dense layer 1."""
    hf = build_qwen3_next_model(tmp_path, norm_topk_prob=True)  # what llama.cpp's qwen3next graph does
    path = write_qwen35_gguf(hf, tmp_path, tmp_path / "next.gguf", arch="qwen3next")
    engine = build_engine(path, device="cpu", dtype="float32", moe_backend="cpu")
    assert engine.config.architecture == "qwen3_next" and engine.config.mlp_only_layers == (1,)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[
            0, len(PROMPT) :
        ].tolist()
    assert rel_err(engine.forward(engine.new_sequence(), PROMPT, all_logits=True), want) < 1e-4
    engine.reset()
    assert [e.token_id for e in engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))] == ref
    engine.close()
