"""The motivating pipeline's four stages: static system prompts (and a tool-schema block) of
realistic length, each followed by a dynamic user turn. Used by `make demo` and the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

CATEGORIES = [
    "billing",
    "outage",
    "account",
    "feature request",
    "bug report",
    "security",
    "legal",
    "sales",
    "onboarding",
    "data export",
    "integration",
    "other",
]

CLASSIFY = (
    "You are the router of a support pipeline. Read the user's request and classify it "
    "into exactly "
    'one category. Reply with JSON only: {"category": ..., "confidence": 0-1, "reason": ...}.\n\n'
    "Categories:\n"
    + "".join(
        f"- {c}: requests about {c}; route to the {c} queue when the main ask is {c}.\n"
        for c in CATEGORIES
    )
    + "\nRules:\n"
    + "".join(
        f"{i}. If the request mentions several topics, pick the one the user asks to act on; "
        "quote the words that decided it in reason, and keep reason under twenty words.\n"
        for i in range(1, 9)
    )
)

REASON = (
    "You are the reasoning stage. Think step by step about the classified request, call tools when "
    "a fact is missing, and never invent account data. Use at most four tool calls. When you have "
    "enough, write a short plan and the facts it rests on.\n\n"
    + "".join(
        f"Guideline {i}: prefer the tool that answers directly; check dates and amounts twice; "
        "say which tool result each fact came from.\n"
        for i in range(1, 13)
    )
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": "string", "description": f"the {p} to use"} for p in params
                },
                "required": params[:1],
            },
        },
    }
    for name, desc, params in [
        (
            "search_tickets",
            "Search earlier support tickets by text and customer.",
            ["query", "customer_id", "since"],
        ),
        (
            "get_account",
            "Fetch an account's plan, status, owner and billing contact.",
            ["customer_id"],
        ),
        (
            "list_invoices",
            "List a customer's invoices with amounts and due dates.",
            ["customer_id", "year"],
        ),
        ("service_status", "Current status and incidents of a named service.", ["service"]),
        (
            "search_docs",
            "Search the product documentation and return matching sections.",
            ["query", "product"],
        ),
        (
            "create_ticket",
            "Open a ticket in a queue with a title and a body.",
            ["queue", "title", "body", "priority"],
        ),
    ]
]

EXAMINE = (
    "You are the examiner. Check the draft answer against the facts and the policy below. "
    "List every "
    "claim that no tool result supports, every number that does not add up, and any promise the "
    'policy forbids. Reply with JSON: {"ok": bool, "problems": [...]}.\n\nPolicy:\n'
    + "".join(
        f"§{i}. Refunds, credits and legal statements need a human; do not promise them. "
        "Never reveal another customer's data. Dates are ISO 8601.\n"
        for i in range(1, 11)
    )
)

SYNTHESIZE = (
    "You are the writer. Turn the approved plan into the final reply to the customer: friendly, "
    "plain words, at most six sentences, with the next step first. Use the customer's language. "
    "Do not mention internal stages, tools or the examiner.\n\nStyle:\n"
    + "".join(
        f"- Rule {i}: short sentences; one idea each; no jargon; no apologies twice; "
        "sign as the support team.\n"
        for i in range(1, 11)
    )
)

STAGES = {
    "classify": {"system": CLASSIFY, "tools": None},
    "reason": {"system": REASON, "tools": TOOLS},
    "examine": {"system": EXAMINE, "tools": None},
    "synthesize": {"system": SYNTHESIZE, "tools": None},
}

REQUEST = (
    "Hi, our dashboard has shown 'sync failed' since Tuesday 09:14 and invoice 2291 was "
    "charged twice. Customer id C-48213. Can you fix the sync and refund one charge?"
)


def user_turn(stage: str, request: str = REQUEST) -> str:
    """The dynamic part of each stage's call: the request plus the previous stage's output."""
    return {
        "classify": request,
        "reason": f"Category: billing (0.82). Request: {request}",
        "examine": f"Draft plan: check invoice 2291, open a billing ticket. Request: {request}",
        "synthesize": f"Approved plan: open a billing ticket for the double charge. {request}",
    }[stage]


def write_manifest(root, model_path) -> Path:
    """Write prompts/, tools.json and manifest.toml for the four stages under `root`."""
    root = Path(root)
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    lines = [f'[[model]]\npath = "{model_path}"\n']
    for name, stage in STAGES.items():
        (root / "prompts" / f"{name}.md").write_text(stage["system"])
        lines.append(f'[[model.prefix]]\nname = "{name}"\nfile = "prompts/{name}.md"\n')
        if stage["tools"]:
            (root / "tools.json").write_text(json.dumps(stage["tools"], indent=1))
            lines.append('tools = "tools.json"\n')
    path = root / "manifest.toml"
    path.write_text("\n".join(lines))
    return path
