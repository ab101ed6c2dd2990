"""gpt-oss behind the server: a chat template ending in harmony's `<|start|>assistant` makes the output
parse as harmony — analysis as reasoning_content, final as content, a commentary message to
functions.NAME as the protocol's tool call, streamed or not (OpenAI SDK over a real server; the model's
tokens forced as in conftest.ScriptedEngine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import API_KEY, ScriptedEngine, running_app
from freetoken.runtime.batcher import Batcher
from freetoken.runtime.engine import build_engine
from freetoken.serve.state import ServeConfig, ServeState
from oracle import build_family_model

# A minimal harmony template (gpt-oss checkpoints ship the full one): tools in a developer message, calls
# as commentary messages to functions.NAME, the generation prompt `<|start|>assistant`.
HARMONY_TEMPLATE = (
    "{%- if tools -%}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- for tc in m.tool_calls -%}<|start|>assistant<|channel|>commentary"
    " to=functions.{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments }}<|call|>"
    "{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
SCRIPTS = {
    "[tool]": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    "[final]": "<|channel|>analysis<|message|>Easy sum.<|end|><|start|>assistant<|channel|>final<|message|>"
    "It is 4.<|return|>",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    import openai

    folder = tmp_path_factory.mktemp("gpt-oss")
    build_family_model(folder, "gpt_oss")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": HARMONY_TEMPLATE}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    engine = build_engine(Path(folder), device="cpu", dtype="float32", moe_backend="fused")
    scripted = ScriptedEngine(engine)
    eos = sorted(engine.stop_ids)[0]
    scripted._scripts = {m: [*engine.tokenizer.encode(t), eos] for m, t in SCRIPTS.items()}
    batcher = Batcher(scripted, max_running=2, max_queued=8, prefix_cache_tokens=4096)  # type: ignore[arg-type]
    state = ServeState(batcher, ("gpt-oss",), ServeConfig(api_key=API_KEY))
    batcher.start()
    with running_app(state) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    batcher.stop()


def test_a_harmony_tool_call_becomes_the_protocols(harmony_client: Any) -> None:
    messages = [{"role": "user", "content": "[tool] Weather in Paris?"}]
    r = harmony_client.chat.completions.create(
        model="gpt-oss", messages=messages, tools=TOOLS, max_tokens=256
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.reasoning_content == "Need the weather."
    chunks = list(
        harmony_client.chat.completions.create(
            model="gpt-oss", messages=messages, tools=TOOLS, max_tokens=256, stream=True
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_harmony_analysis_is_reasoning_and_final_is_content(harmony_client: Any) -> None:
    messages = [{"role": "user", "content": "[final] 2 + 2?"}]
    r = harmony_client.chat.completions.create(model="gpt-oss", messages=messages, max_tokens=256)
    message = r.choices[0].message
    assert (message.content, message.reasoning_content) == ("It is 4.", "Easy sum.")
