"""The engine from Python: build once, chat, then re-split experts between GPU slots and the CPU.

python examples/python_api.py            # the built-in demo model (random weights)
python examples/python_api.py ./model    # any model folder, FTW folder or .gguf file
"""

from __future__ import annotations

import sys

from freetoken.runtime.config import MoeConfig
from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.model_ref import resolve_model
from freetoken.runtime.sampling import SamplingParams


def main() -> None:
    path = resolve_model(sys.argv[1] if len(sys.argv) > 1 else "demo")
    engine = build_engine(path)  # device, dtype and MoE backend: auto
    messages = [{"role": "user", "content": "Name three uses of a mixture-of-experts model."}]
    params = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=48, seed=0)
    for event in engine.chat(messages, params):
        print(event.text, end="", flush=True)
    print()
    print(event.stats.as_dict() if event.stats else {})
    # Memory changes speed, never results: rebuild the expert executor with a quarter of the pool as slots.
    engine.configure_moe(MoeConfig("offload" if engine.device.type == "cuda" else "cpu", cache_ratio=0.25))
    tokens = [e.token_id for e in engine.chat(messages, SamplingParams(max_tokens=8))]
    print(f"greedy tokens with backend {engine.backend}: {tokens}")
    print(engine.moe_counters.as_dict()["per_token"])
    engine.close()


if __name__ == "__main__":
    main()
