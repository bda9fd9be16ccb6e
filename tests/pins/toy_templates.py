"""Toy chat templates with per-request content before the system text (the user turn, a date,
the time of day), and a tiny tokenizer that carries one: what the render tests cut pins from."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.utils import load_tokenizer

from kvstore.tiny import write_tokenizer

# Per-request content before the system text: the user turn, or a date.
USER_FIRST_TEMPLATE = (
    "{% for m in messages if m['role'] == 'user' %}"
    "<|im_start|>user\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% for m in messages if m['role'] != 'user' %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A date the template hard-codes (Llama 3.1/3.3's "26 Jul 2024"): real requests never change it.
DATED_TEMPLATE = (
    "<|im_start|>system\nThe date is {{ date_string | default('26 Jul 2024') }}. "
    "{{ messages[0]['content'] }}<|im_end|>\n"
    "{% for m in messages[1:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The time of day from transformers' strftime_now: it changes faster than daily.
TIMED_TEMPLATE = DATED_TEMPLATE.replace(
    "{{ date_string | default('26 Jul 2024') }}", "{{ strftime_now('%d %b %Y %H:%M') }}"
)


def tokenizer_with(path: Path, template: str | None = None):
    """A tiny tokenizer (kvstore.tiny) with `template` as its chat template, loaded by mlx-lm."""
    if template is None:
        write_tokenizer(path)
    else:
        write_tokenizer(path, chat_template=template)
    return load_tokenizer(path)
