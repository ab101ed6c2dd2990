"""Talk to a running `freetoken serve` through the Anthropic SDK (streamed, as Claude Code does).

freetoken serve demo &
python examples/anthropic_client.py [--base-url http://HOST:PORT] [--model NAME]
(defaults: $FREETOKEN_URL or http://127.0.0.1:8000; $FREETOKEN_MODEL or demo, a name the server serves)
"""

import argparse
import os

from anthropic import Anthropic

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--base-url", default=os.environ.get("FREETOKEN_URL", "http://127.0.0.1:8000"))
ap.add_argument("--model", default=os.environ.get("FREETOKEN_MODEL", "demo"), help="a name the server serves")
args = ap.parse_args()
key = os.environ.get("FREETOKEN_API_KEY", "none")
client = Anthropic(base_url=args.base_url.rstrip("/"), api_key=key)
with client.messages.stream(
    model=args.model,
    max_tokens=48,
    system="Answer in one line.",
    messages=[{"role": "user", "content": "What is a mixture of experts?"}],
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
    usage = stream.get_final_message().usage
print(f"\n[{usage.input_tokens} new input tokens, {usage.cache_read_input_tokens} from cache]")
