"""The built-in demo model's tokenizer: a small byte-level BPE with Qwen3-style chat tokens.

Everything is derived from constants in this file by a deterministic procedure, so writing the
tokenizer twice gives identical bytes and the demo needs no download.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from functools import lru_cache
from itertools import pairwise
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from freetoken.errors import FreeTokenError

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 4096
TARGET_VOCAB_SIZE = 768  # 256 bytes + learned merges + special tokens, if the corpus has enough pairs

_CORPUS = """\
The morning was cold and clear, and the river ran quietly under the old stone bridge. People walked
to work with their hands in their pockets, talking about the weather, the news and the price of bread.
A small dog followed a boy to school, and the teacher let it sit by the door until the bell rang.
In the afternoon the wind changed, the clouds came in from the sea, and by the evening it was raining.
Hello! How are you today? I am fine, thank you. What would you like to do this weekend? We could go
for a walk in the park, visit the museum, or stay at home and read a good book by the window.
The assistant answers the user's question in a short and helpful way. If the question is not clear,
the assistant asks the user what they mean. The user can ask about history, science, cooking, travel,
programming, music, sports and many other things. The assistant should think about the problem first,
and then give the answer. When a tool is needed, the assistant calls the tool with the right arguments
and waits for the tool response before it answers.
To make a simple tomato soup, cook an onion and two cloves of garlic in a little oil. Add the tomatoes,
some water and a pinch of salt, then let it simmer for twenty minutes. Blend the soup until it is smooth
and serve it with fresh bread. The same method works for carrots, peas, pumpkin and many other vegetables.
A computer program is a list of instructions. The computer reads each instruction and does what it
says. A function takes some input, does some work and returns a result. For example, a function named
get_weather could take the name of a city and return the current temperature, the wind and the chance
of rain. Programs store numbers, strings, lists and objects in memory, and they read and write files.
def add(a, b):
    return a + b

for item in items:
    print(item)

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "the history of the printing press"}}
{"type": "function", "function": {"name": "get_time", "description": "Get the time", "parameters": {}}}
The printing press changed the way people shared ideas. Before it, books were copied by hand, which
took a long time and cost a lot of money. After it, books became cheaper, more people learned to read,
and new ideas could travel from one country to another in a few weeks instead of many years.
The train left the station at seven o'clock. It was full of students going home for the holidays,
families with children, and workers with heavy bags. Outside the window the fields were green, and
the trees along the road were starting to turn yellow and red. Somebody was playing music quietly.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 20 25 50 100 2024 3.14 1,000 - one two three four five six seven.
The sun is a star. The earth moves around the sun once a year, and it turns around itself once a day.
The moon moves around the earth, and we see it change its shape during the month. Water boils at one
hundred degrees and freezes at zero degrees. Plants need light, water and air to grow, and animals
need plants or other animals to eat. Scientists study these things by asking questions, making
measurements, and testing their ideas against what they observe in the world.
Thank you for your question. Here is a short answer, followed by a longer explanation with examples.
First, let me think about what you are asking. Second, I will check the facts. Finally, I will write
the answer in a clear and friendly way. Please let me know if you would like more information.
Our village has a market every Saturday. Farmers bring apples, cheese, eggs and honey, and the baker
sells warm bread and cakes. Children run between the tables while their parents talk with friends.
In the summer there is music in the square, and in the winter people drink hot tea to keep warm.
The weather tomorrow will be sunny in the morning, with some clouds in the afternoon and a light wind
from the west. The temperature will be around eighteen degrees, and there is a small chance of rain
in the evening. Remember to take an umbrella if you are going out late, just in case it changes.
Learning a new language takes time and patience. Start with simple words and short sentences, listen
to people speaking, and practice a little every day. Do not worry about making mistakes: everybody
makes them, and they are an important part of learning. Reading stories and watching films also helps.
"""

_CHAT_TEMPLATE = r"""
{%- macro render_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content | tojson -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- render_text(messages[0].content) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nThese functions are available; each signature is a JSON object inside '
        '<tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo use a function, answer with one <tool_call></tool_call> block per call, '
        'each holding a JSON object with the function name and its arguments:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_text(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set text = render_text(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- '<|im_start|>system\n' + text + '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + text + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
        {%- if '</think>' in text -%}
            {%- if not reasoning -%}
                {%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}
            {%- endif -%}
            {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user and reasoning -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- text -}}
        {%- if message.tool_calls is defined -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
                {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- fn.arguments | default({}) | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('unsupported chat role: ' + (message.role | string)) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte value 0..255 used by byte-level BPE (GPT-2's mapping)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@lru_cache(maxsize=1)
def _learn_merges() -> tuple[tuple[str, str], ...]:
    """Greedy BPE on the built-in corpus; ties break on the pair itself so the result never varies."""
    words = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(_CORPUS))
    seqs = [list(word) for word in words]
    freqs = [words[word] for word in words]
    pair_counts: Counter[tuple[str, str]] = Counter()
    where: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for index, seq in enumerate(seqs):
        for pair in pairwise(seq):
            pair_counts[pair] += freqs[index]
            where[pair].add(index)

    known = set(_byte_symbols())
    merges: list[tuple[str, str]] = []
    budget = TARGET_VOCAB_SIZE - len(SPECIAL_TOKENS)
    while len(known) < budget:
        best = min(
            (pair for pair, count in pair_counts.items() if count >= 2),
            key=lambda pair: (-pair_counts[pair], pair),
            default=None,
        )
        if best is None:
            break
        merges.append(best)
        merged = best[0] + best[1]
        known.add(merged)
        for index in sorted(where.pop(best)):
            seq, freq = seqs[index], freqs[index]
            for pair in pairwise(seq):
                pair_counts[pair] -= freq
            out: list[str] = []
            i = 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[index] = out
            for pair in pairwise(out):
                pair_counts[pair] += freq
                where[pair].add(index)
        # Invariant: pair_counts holds only pairs that still occur somewhere.
        for pair in [p for p, c in pair_counts.items() if c <= 0]:
            del pair_counts[pair]
    return tuple(merges)


def build_demo_tokenizer() -> HFTokenizer:
    """The demo tokenizer as a `tokenizers` object: byte ids 0..255, then merges, then special tokens."""
    vocab: dict[str, int] = {symbol: i for i, symbol in enumerate(_byte_symbols())}
    merges = list(_learn_merges())
    for left, right in merges:
        # Two different pairs can spell the same string; the token keeps its first id.
        vocab.setdefault(left + right, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in SPECIAL_TOKENS]
    )
    return tok


def _tokenizer_config(tok: HFTokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_demo_tokenizer(out_dir: Path) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; return the vocabulary size."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FreeTokenError(f"cannot create tokenizer directory {out_dir}: {exc.strerror}") from exc
    tok = build_demo_tokenizer()
    # Re-serialise through json so the bytes depend only on our key order, not the library's formatting.
    (out_dir / "tokenizer.json").write_text(_dump(json.loads(tok.to_str())), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(_dump(_tokenizer_config(tok)), encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
