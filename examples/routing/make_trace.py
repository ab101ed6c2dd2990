"""Record the committed example trace: the demo model answering four chat turns, 160 tokens each.

    python examples/routing/make_trace.py            # writes examples/routing/demo_trace.npz
    freetoken replay routing examples/routing/demo_trace.npz --capacity 0.05:0.5:0.05 \
        --plot examples/routing/miss_rate.png
"""

from pathlib import Path

from freetoken.replay.recorder import attach_recorder
from freetoken.runtime.engine import build_engine
from freetoken.runtime.loading.demo import ensure_demo_model
from freetoken.runtime.sampling import SamplingParams

QUESTIONS = [
    "Explain how a mixture of experts model routes each token to a few experts.",
    "Why does caching the experts on a small GPU work?",
    "What happens when the cache is too small?",
    "Summarise the answer in three sentences.",
]

engine = build_engine(ensure_demo_model(), device="cpu")
recorder = attach_recorder(engine)
history = []
for question in QUESTIONS:
    history.append({"role": "user", "content": question})
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=len(history), max_tokens=160, ignore_eos=True)
    answer = "".join(event.text for event in engine.chat(history, params))
    history.append({"role": "assistant", "content": answer})
path = recorder.save(Path(__file__).with_name("demo_trace.npz"))
print(f"{len(recorder.trace())} token rows in {recorder.passes} passes -> {path}")
