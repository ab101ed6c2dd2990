"""Each family behind the server with a chat template in its own style (the checkpoints ship longer
ones): the OpenAI SDK streams its answer, and a tool call in the family's own format — GLM-4.5's
`<arg_key>`/`<arg_value>` pairs, MiniMax-M2's `<invoke>` block, DeepSeek-V3's and Kimi's call sections,
Mixtral's `[TOOL_CALLS]` list — becomes the protocol's tool call,
streamed or not. The model's tokens are forced (conftest.ScriptedEngine); everything else is the real
path. gpt-oss (harmony) has its own test file."""

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


def _template(turn: str, assistant: str, generation: str, tools: str = "") -> str:
    """A chat template: each message through `turn` (role and content in scope), `generation` last."""
    return (
        tools
        + "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
        + assistant
        + "{%- else -%}"
        + turn
        + "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}"
        + generation
        + "{%- endif -%}"
    )


TOOLS_LIST = "{%- if tools -%}<|system|>\n# Tools\n{{ tools | tojson }}{%- endif -%}"
FAMILIES = {
    "mixtral": dict(
        template=_template(
            "[INST] {{ m.content }} [/INST]",
            "{{ m.content }}</s>",
            "",
            "{%- if tools -%}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}",
        ),
        scripts={
            "[plain]": "Bonjour, Paris est ensoleillé.",
            "[tool]": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]',
        },
    ),
    "olmoe": dict(
        template=_template(
            "<|{{ m.role }}|>\n{{ m.content }}\n", "<|assistant|>\n{{ m.content }}\n", "<|assistant|>\n"
        ),
        scripts={"[plain]": "Bonjour, Paris est ensoleillé."},
    ),
    "glm4_moe": dict(
        template=_template(
            "<|{{ m.role }}|>\n{{ m.content }}", "<|assistant|>\n{{ m.content }}", "<|assistant|>", TOOLS_LIST
        ),
        scripts={
            "[plain]": "<think>Say it in French.</think>\nBonjour, Paris est ensoleillé.",
            "[tool]": "<think>Need the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        },
    ),
    "minimax_m2": dict(
        template=_template(
            "]~b]{{ m.role }}\n{{ m.content }}[e~[\n",
            "]~b]ai\n{{ m.content }}[e~[\n",
            "]~b]ai\n<think>\n",
            TOOLS_LIST,
        ),
        scripts={
            "[plain]": "Say it in French.\n</think>\n\nBonjour, Paris est ensoleillé.",
            "[tool]": 'Need the weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
            '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n'
            "</minimax:tool_call>",
        },
    ),
    "deepseek_v3": dict(
        template=_template(
            "<｜{{ m.role }}｜>{{ m.content }}",
            "<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>",
            "<｜Assistant｜><think>",
            TOOLS_LIST,
        ),
        scripts={
            "[plain]": "Say it in French.</think>Bonjour, Paris est ensoleillé.",
            "[tool]": "Need the weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
            '<｜tool▁sep｜>{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        },
    ),
    "kimi_linear": dict(
        template=_template(
            "<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>",
            "<|im_assistant|>assistant<|im_middle|>{{ m.content }}<|im_end|>",
            "<|im_assistant|>assistant<|im_middle|>",
            TOOLS_LIST,
        ),
        scripts={
            "[plain]": "<think>Say it in French.</think>Bonjour, Paris est ensoleillé.",
            "[tool]": "<think>Need the weather.</think><|tool_calls_section_begin|><|tool_call_begin|>"
            'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
            "<|tool_calls_section_end|>",
        },
    ),
}
REASONING = {
    family: "Say it in French." for family in ("glm4_moe", "minimax_m2", "deepseek_v3", "kimi_linear")
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_client(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    import openai

    family = request.param
    folder = tmp_path_factory.mktemp(f"serve-{family}")
    build_family_model(folder, family)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": FAMILIES[family]["template"]}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    engine = build_engine(Path(folder), device="cpu", dtype="float32", moe_backend="fused")
    scripted = ScriptedEngine(engine)
    eos = sorted(engine.stop_ids)[0]
    scripted._scripts = {
        m: [*engine.tokenizer.encode(t), eos] for m, t in FAMILIES[family]["scripts"].items()
    }
    batcher = Batcher(scripted, max_running=2, max_queued=8, prefix_cache_tokens=4096)  # type: ignore[arg-type]
    state = ServeState(batcher, (family,), ServeConfig(api_key=API_KEY))
    batcher.start()
    with running_app(state) as url:
        yield family, openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    batcher.stop()


def test_the_sdk_streams_the_answer(family_client: tuple[str, Any]) -> None:
    family, client = family_client
    messages = [{"role": "user", "content": "[plain] Weather in Paris, in French?"}]
    chunks = list(
        client.chat.completions.create(model=family, messages=messages, max_tokens=128, stream=True)
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert content == "Bonjour, Paris est ensoleillé."
    assert reasoning == REASONING.get(family, "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]
    whole = client.chat.completions.create(model=family, messages=messages, max_tokens=128)
    assert whole.choices[0].message.content == content


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_in_the_familys_format_becomes_the_protocols(
    family_client: tuple[str, Any], stream: bool
) -> None:
    family, client = family_client
    if "[tool]" not in FAMILIES[family]["scripts"]:
        pytest.skip(f"{family}'s chat templates write no tool calls")
    messages = [{"role": "user", "content": "[tool] Weather in Paris for three days?"}]
    reply = client.chat.completions.create(
        model=family, messages=messages, tools=TOOLS, max_tokens=256, stream=stream
    )
    if stream:
        chunks = list(reply)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = reply.choices[0]
        calls, finish, content = (
            choice.message.tool_calls,
            [choice.finish_reason],
            choice.message.content or "",
        )
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    assert finish == ["tool_calls"] and content == ""
