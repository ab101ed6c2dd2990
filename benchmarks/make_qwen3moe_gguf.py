"""Write a random-weight GGUF with Qwen3-30B-A3B's shapes (llama.cpp's `qwen3moe` arch): make_family_gguf.py
with `--family qwen3moe`, its options and defaults.

  python benchmarks/make_qwen3moe_gguf.py /dev/shm/q30-q4km.gguf --layers 24 --expert-type Q4_K_M
  python benchmarks/make_qwen3moe_gguf.py /tmp/small.gguf --layers 16 --hidden 1024 --experts 64 \\
      --moe-inter 512 --heads 16 --head-dim 64 --vocab 32000
"""

from __future__ import annotations

from make_family_gguf import main

if __name__ == "__main__":
    main(family="qwen3moe")
