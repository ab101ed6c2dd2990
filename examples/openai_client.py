"""Chat with a running `freetoken serve` through the OpenAI SDK (streamed).

freetoken serve demo &        # or any model; add --api-key KEY to require one
python examples/openai_client.py [--base-url http://HOST:PORT] [--model NAME]
(defaults: $FREETOKEN_URL or http://127.0.0.1:8000; $FREETOKEN_MODEL or demo, a name the server serves)
"""

import argparse
import os

from openai import OpenAI

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--base-url", default=os.environ.get("FREETOKEN_URL", "http://127.0.0.1:8000"))
ap.add_argument("--model", default=os.environ.get("FREETOKEN_MODEL", "demo"), help="a name the server serves")
args = ap.parse_args()
key = os.environ.get("FREETOKEN_API_KEY", "none")
client = OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=key)
stream = client.chat.completions.create(
    model=args.model,
    messages=[{"role": "user", "content": "Write one line about the sea."}],
    max_tokens=48,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt tokens, {chunk.usage.completion_tokens} generated]")
