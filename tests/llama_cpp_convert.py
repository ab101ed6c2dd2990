"""Run llama.cpp's own HF -> GGUF converter (`make llama-cpp-converter` fetches it) on a tiny model folder:

    python tests/llama_cpp_convert.py CONVERTER_DIR MODEL_DIR OUT.gguf HF_ARCHITECTURE [fuse]

(`fuse`: the experts' gate and up banks as one, as the converter's --fuse-gate-up-exps writes them.)

The tiny models carry the demo tokenizer, whose hash the converter's pre-tokenizer table does not know;
the converter class is subclassed to write it as byte-level BPE with the family's own pre-tokenizer
named (its splits matter to the tokenizer's test, not to the weights). Multi-token-prediction blocks
are left out (the tiny models have none). Run as its own process: the converter puts its own `gguf`
package first on the path."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PRE_TOKENIZERS = {
    "Qwen3_5MoeForCausalLM": "qwen35",
    "Qwen3NextForCausalLM": "qwen2",
    "DeepseekV32ForCausalLM": "deepseek-v3",
    "KimiLinearForCausalLM": "kimi-k2",
    "DeepseekV4ForCausalLM": "deepseek-v3",
}


def main() -> None:
    root, model_dir, out, architecture = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    sys.path[:0] = [str(root / "gguf-py"), str(root)]
    import gguf
    from conversion import get_model_class

    base = get_model_class(architecture)

    class Converter(base):  # type: ignore[misc, valid-type]
        model_arch = base.model_arch
        no_mtp = True

        def get_vocab_base_pre(self, tokenizer: object) -> str:
            return PRE_TOKENIZERS[architecture]

        def set_vocab(self) -> None:  # the demo tokenizer as byte-level BPE (DeepSeek's would ask for a BOS)
            # read from the tokenizer files alone: transformers' config class would refuse the tiny
            # DeepSeek-V4's compress ratios (it maps only the published 4 and 128 to layer kinds)
            with tempfile.TemporaryDirectory() as tmp:
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(self.dir_model / name, Path(tmp) / name)
                model_dir, self.dir_model = self.dir_model, Path(tmp)
                try:
                    self._set_vocab_gpt2()
                finally:
                    self.dir_model = model_dir

    Converter(
        model_dir, gguf.LlamaFileType.ALL_F32, out, is_big_endian=False, use_temp_file=False, eager=True,
        metadata_override=None, model_name=None, split_max_tensors=0, split_max_size=0, dry_run=False,
        small_first_shard=False, remote_hf_model_id=None, fuse_gate_up_exps=sys.argv[5:] == ["fuse"],
    ).write()  # fmt: skip


if __name__ == "__main__":
    main()
