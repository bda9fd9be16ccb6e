"""Real chat templates battery: a tiny mlx-lm model per family, rendered as mlx_lm.server does.

Each family names a template file under `tests/pins/chat_templates/` (sources in SOURCES.md
there), the control tokens that template emits and that the real tokenizer knows as single special
tokens, its BOS/EOS, and whether the real tokenizer prepends BOS on `encode`. `make_family_model`
writes a random-weight llama directory whose tokenizer has exactly those tokens and carries the
template in tokenizer_config.json, so `mlx_lm.utils.load_tokenizer` renders as the real model's
would.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tiny import make_tiny_model

TEMPLATES_DIR = Path(__file__).parent / "chat_templates"

LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA31 = LLAMA3 + ("<|eom_id|>", "<|python_tag|>")
CHATML = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
MISTRAL = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
)
DEEPSEEK = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
)


@dataclass(frozen=True)
class Family:
    """One model family's real chat template and the tokenizer facts that shape its token stream."""

    name: str
    template: str  # file name under tests/pins/chat_templates/
    control_tokens: tuple[str, ...]  # single special tokens in the real tokenizer
    bos_token: str | None
    eos_token: str
    add_bos: bool  # the real tokenizer prepends BOS on encode(add_special_tokens=True)
    supports_system: bool  # a leading system message renders (instead of raising)
    supports_tools: bool  # `tools=` (OpenAI function schemas) is rendered into the prompt
    added_tokens: tuple[str, ...] = ()  # added but not special in the real tokenizer (<think>)
    tools_variant: bool = False  # a `tool_use` template: transformers picks it only with tools
    pad_token: str | None = None
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)
    notes: str = ""

    @property
    def template_text(self) -> str:
        return (TEMPLATES_DIR / self.template).read_text()


FAMILIES: tuple[Family, ...] = (
    Family(
        "llama3_1",
        "llama3_1.jinja",
        LLAMA31,
        "<|begin_of_text|>",
        "<|eot_id|>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="prints {{ bos_token }} itself; date_string defaults to '26 Jul 2024' (no clock); "
        "tools go into the first user turn and the template raises without one",
    ),
    Family(
        "llama3_1_json_vllm",
        "llama3_1_json_vllm.jinja",
        LLAMA3,
        "<|begin_of_text|>",
        "<|eot_id|>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="vLLM's Llama 3.1 JSON tool template: strftime_now('%d %b %Y') in the system header",
    ),
    Family(
        "llama3_2",
        "llama3_2.jinja",
        LLAMA3,
        "<|begin_of_text|>",
        "<|eot_id|>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="strftime_now('%d %b %Y') in the system header; tools in the first user turn",
    ),
    Family(
        "llama3_3",
        "llama3_3.jinja",
        LLAMA31,
        "<|begin_of_text|>",
        "<|eot_id|>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="same text as 3.1: hard-coded default date '26 Jul 2024'",
    ),
    Family(
        "qwen2_5",
        "qwen2_5.jinja",
        CHATML,
        None,
        "<|im_end|>",
        add_bos=False,
        supports_system=True,
        supports_tools=True,
        added_tokens=("<tool_call>", "</tool_call>"),
        notes="default system 'You are Qwen...' when none is given; tools in the system turn",
    ),
    Family(
        "qwen3",
        "qwen3.jinja",
        CHATML,
        None,
        "<|im_end|>",
        add_bos=False,
        supports_system=True,
        supports_tools=True,
        added_tokens=(
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
        notes="mlx-lm passes enable_thinking=True (has <think>); <think></think> only on assistant "
        "turns after the last user query",
    ),
    Family(
        "gemma2",
        "gemma2.jinja",
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
        "<bos>",
        "<eos>",
        add_bos=True,
        supports_system=False,
        supports_tools=False,
        pad_token="<pad>",
        notes="raises 'System role not supported'",
    ),
    Family(
        "gemma3",
        "gemma3.jinja",
        ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
        "<bos>",
        "<eos>",
        add_bos=True,
        supports_system=True,
        supports_tools=False,
        pad_token="<pad>",
        notes="system text is folded into the first user turn (first_user_prefix)",
    ),
    Family(
        "mistral_nemo",
        "mistral_nemo.jinja",
        MISTRAL,
        "<s>",
        "</s>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="system text is prepended to the LAST user turn; [AVAILABLE_TOOLS] before the last "
        "user turn",
    ),
    Family(
        "mistral_small3_2",
        "mistral_small3_2.jinja",
        MISTRAL
        + ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]"),
        "<s>",
        "</s>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        notes="[SYSTEM_PROMPT] first; [AVAILABLE_TOOLS] before the last user turn; the default "
        "system message (used only without one) carries strftime_now('%Y-%m-%d')",
    ),
    Family(
        "phi3_5",
        "phi3_5.jinja",
        ("<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        "<s>",
        "<|endoftext|>",
        add_bos=False,
        supports_system=True,
        supports_tools=False,
        notes="eos_token instead of the assistant header when add_generation_prompt is False",
    ),
    Family(
        "phi4_mini",
        "phi4_mini.jinja",
        (
            "<|endoftext|>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "<|tool|>",
            "<|/tool|>",
        ),
        "<|endoftext|>",
        "<|endoftext|>",
        add_bos=False,
        supports_system=True,
        supports_tools=False,
        notes="ignores tools=; tools go as a JSON string in the system message's 'tools' key; "
        "without a generation prompt it ends with eos_token instead of <|assistant|>",
    ),
    Family(
        "deepseek_v3_1",
        "deepseek_v3_1.jinja",
        DEEPSEEK,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        add_bos=True,
        supports_system=True,
        supports_tools=False,
        added_tokens=("<think>", "</think>"),
        notes="prints {{ bos_token }} + system text before the first user turn; thinking= kwarg; "
        "tools= not rendered (tools are described in the system text by the app)",
    ),
    Family(
        "deepseek_r1_distill_llama",
        "deepseek_r1_distill_llama.jinja",
        DEEPSEEK,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        add_bos=True,
        supports_system=True,
        supports_tools=False,
        added_tokens=("<think>", "</think>"),
        notes="generation prompt ends with <think>\\n; tools= not rendered",
    ),
    Family(
        "gpt_oss",
        "gpt_oss.jinja",
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|message|>",
            "<|end|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        "<|startoftext|>",
        "<|return|>",
        add_bos=False,
        supports_system=True,
        supports_tools=True,
        pad_token="<|endoftext|>",
        notes="harmony: the system header carries strftime_now('%Y-%m-%d') before everything; the "
        "system message becomes the developer message; reasoning_effort defaults to medium",
    ),
    Family(
        "hermes3",
        "hermes3.jinja",
        LLAMA3[:1] + CHATML[:2] + ("<|eot_id|>",),
        "<|begin_of_text|>",
        "<|im_end|>",
        add_bos=True,
        supports_system=True,
        supports_tools=True,
        tools_variant=True,
        notes="tool_use variant (the model's default variant, plain ChatML, is used without tools "
        "and is not in the battery): tools in a fixed system turn before the app's system turn",
    ),
    Family(
        "granite3_3",
        "granite3_3.jinja",
        ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
        "<|end_of_text|>",
        "<|end_of_text|>",
        add_bos=False,
        supports_system=True,
        supports_tools=True,
        notes="strftime_now('%B %d, %Y') only in the default system message (used when the app "
        "gives none)",
    ),
)

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}

# -- realistic request content ---------------------------------------------------------------

SYSTEM_PROMPT = (
    "You are the support assistant for Northwind Outfitters, an online shop for hiking and "
    "camping gear. Answer questions about orders, returns, shipping and products in a friendly, "
    "concise tone. Always check the order status with the tools before you promise a delivery "
    "date. Never share one customer's details with another customer. If a request is outside the "
    "shop's business, say so politely and suggest where the customer could look instead."
)

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "get_order_status",
            "description": "Look up the shipping status and expected delivery date of an order.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "description": "The order number."},
                },
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_products",
            "description": "Search the product catalog and return matching items with prices.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What the customer looks for."},
                    "max_results": {"type": "integer", "description": "How many items to return."},
                },
                "required": ["query"],
            },
        },
    },
]

FEW_SHOT: list[dict] = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "Where is my order 1042?"},
    {
        "role": "assistant",
        "content": "Your order 1042 shipped on Monday and should arrive by Thursday.",
    },
    {"role": "user", "content": "Do you sell tents for two people?"},
    {
        "role": "assistant",
        "content": "Yes: the Trailhead 2 and the Ridgeline 2 are both two-person tents.",
    },
]

# Different content and length, as real requests are.
USER_TURNS: tuple[str, ...] = (
    "Can I return a sleeping bag I bought last week?",
    "What is the difference between the Trailhead 2 and the Ridgeline 2 tents, and which one is "
    "lighter to carry?",
    "Hi!",
    "My order 2077 has not arrived yet. It was supposed to come on Friday. Can you check what "
    "happened and tell me when it will arrive?",
)

# Fixed phrases of the templates, so the tiny BPE keeps them (and the probes) a few tokens long.
_TEMPLATE_PHRASES = (
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\nEnvironment: ipython\n",
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.",
    'Respond in the format {"name": function name, "parameters": dictionary of argument name '
    "and its value}. Do not use variables.",
    "You may call one or more functions to assist with the user query. You are provided with "
    "function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "You are ChatGPT, a large language model trained by OpenAI. Knowledge cutoff: 2024-06 "
    "Current date: Reasoning: medium # Valid channels: analysis, commentary, final. Channel must "
    "be included for every message. Calls to these tools must go to the commentary channel: "
    "'functions'. # Tools ## functions namespace functions { type = (_: { }) => any; // } "
    "# Instructions developer system",
    '"type": "function", "function": {"name": "description": "parameters": "properties": '
    '"required": "object" "string" "integer"',
    "January February March April May June July August September October November December "
    "Jan Feb Mar Apr Jun Jul Aug Sep Oct Nov Dec Monday Tuesday Friday 2024 2025 2026",
)

CORPUS: tuple[str, ...] = (
    SYSTEM_PROMPT,
    *USER_TURNS,
    *(m["content"] for m in FEW_SHOT[1:]),
    json.dumps(TOOLS),
    json.dumps(TOOLS, indent=4),
    *_TEMPLATE_PHRASES,
)


def messages_for(family: Family, user: str, *, few_shot: bool = False) -> list[dict]:
    """A real request's messages: the system prompt (or few-shot block) then one user turn."""
    pinned = list(FEW_SHOT) if few_shot else [{"role": "system", "content": SYSTEM_PROMPT}]
    if not family.supports_system:
        pinned = pinned[1:]
    return pinned + [{"role": "user", "content": user}]


# -- the model and the rendering ---------------------------------------------------------------


def make_family_model(path: str | Path, family: Family | str, *, seed: int = 0) -> Path:
    """Write a tiny llama model whose tokenizer imitates `family`'s and carries its template."""
    family = BY_NAME[family] if isinstance(family, str) else family
    return make_tiny_model(
        path,
        "llama",
        seed=seed,
        chat_template=family.template_text,
        tokenizer=dict(
            special_tokens=list(family.control_tokens),
            added_tokens=list(family.added_tokens),
            bos_token=family.bos_token,
            eos_token=family.eos_token,
            pad_token=family.pad_token,
            add_bos=family.add_bos,
            corpus=list(CORPUS),
        ),
    )


def request_tokens(
    tokenizer,
    messages: Sequence[Mapping],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> list[int]:
    """Token ids of a chat request, rendered exactly as `mlx_lm.server` renders one.

    The server calls the TokenizerWrapper (which injects enable_thinking when the vocabulary has
    <think>) with add_generation_prompt=True, tools (None when the request has none) and its
    --chat-template-args merged with the request's chat_template_kwargs.
    """
    out = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=True,
        tools=tools,
        tokenize=True,
        **dict(chat_template_kwargs or {}),
    )
    if isinstance(out, Mapping) or hasattr(
        out, "keys"
    ):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return [int(t) for t in out]


def request_text(
    tokenizer,
    messages: Sequence[Mapping],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> str:
    """The same rendering as `request_tokens`, as text (to locate content in the stream)."""
    return tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=True,
        tools=tools,
        tokenize=False,
        **dict(chat_template_kwargs or {}),
    )


def server_system_end(
    tokenizer,
    messages: Sequence[Mapping],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: Mapping[str, object] | None = None,
) -> int:
    """Where `mlx_lm.server` ends the "system" segment of this request (0: it makes none).

    As the server does: render the leading system messages plus an empty user turn without a
    generation prompt, and take the first token where that differs from the request.
    """
    prompt = request_tokens(
        tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs
    )
    num_system = 0
    for m in messages:
        if m["role"] != "system":
            break
        num_system += 1
    if num_system == 0 or messages[-1]["role"] != "user":
        return 0
    sys_tokens = tokenizer.apply_chat_template(
        list(messages[:num_system]) + [{"role": "user", "content": ""}],
        add_generation_prompt=False,
        tools=tools,
        tokenize=True,
        **dict(chat_template_kwargs or {}),
    )
    if isinstance(sys_tokens, Mapping) or hasattr(sys_tokens, "keys"):
        sys_tokens = sys_tokens["input_ids"]
    for i, (a, b) in enumerate(zip(sys_tokens, prompt)):
        if a != b:
            return i if i < len(prompt) else 0
    return 0  # the server sets no boundary when one rendering is a prefix of the other


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def text_end_token(tokenizer, tokens: Sequence[int], text: str) -> int | None:
    """Number of leading tokens whose decoding first contains `text` (None when it never does)."""
    lo, hi = 0, len(tokens)
    if text not in tokenizer.decode(list(tokens)):
        return None
    while lo < hi:  # decoding a longer prefix never removes text already decoded
        mid = (lo + hi) // 2
        if text in tokenizer.decode(list(tokens[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


@contextlib.contextmanager
def clock_at(day: _dt.date | _dt.datetime) -> Iterator[None]:
    """Make the templates' `strftime_now` (transformers' jinja global) see `day`."""
    from transformers.utils import chat_template_utils

    moment = day if isinstance(day, _dt.datetime) else _dt.datetime.combine(day, _dt.time(12))
    real = chat_template_utils.datetime

    class _Frozen(_dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return moment if tz is None else moment.astimezone(tz)

    chat_template_utils.datetime = _Frozen
    try:
        yield
    finally:
        chat_template_utils.datetime = real


# -- pytest helper: one model per family per session ---------------------------------------------


class FamilyModels:
    """Builds each family's model once under a session directory (use from a session fixture)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._tokenizers: dict[str, object] = {}

    def path(self, family: Family | str) -> Path:
        name = family if isinstance(family, str) else family.name
        path = self.root / name
        if not (path / "config.json").is_file():
            make_family_model(path, name)
        return path

    def tokenizer(self, family: Family | str):
        from mlx_lm.utils import load_tokenizer

        name = family if isinstance(family, str) else family.name
        if name not in self._tokenizers:
            self._tokenizers[name] = load_tokenizer(self.path(name))
        return self._tokenizers[name]
