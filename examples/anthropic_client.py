"""Talk to a running `freetoken serve` through the Anthropic SDK (streamed, as Claude Code does).

    freetoken serve demo &
    python examples/anthropic_client.py
"""

import os

from anthropic import Anthropic

client = Anthropic(base_url="http://127.0.0.1:8000", api_key=os.environ.get("FREETOKEN_API_KEY", "none"))
with client.messages.stream(
    model="demo",
    max_tokens=48,
    system="Answer in one line.",
    messages=[{"role": "user", "content": "What is a mixture of experts?"}],
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
    usage = stream.get_final_message().usage
print(f"\n[{usage.input_tokens} new input tokens, {usage.cache_read_input_tokens} from cache]")
