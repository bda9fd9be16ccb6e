"""Static-first: the lines that are the same in every prompt stay where they are, in order; the
lines that vary move into one trailing user turn. `kvstore analyze` reorders captured prompts
this way to measure what a cache would serve; `kvstore explain` suggests it for a divergence
inside content the app keeps static. Pure (no mlx)."""

from __future__ import annotations

from collections import Counter

REALIGN_CHARS = 8  # after a dynamic block, this much identical text means the static text goes on


def static_lines(groups: list[list[str]]) -> list[str]:
    """Lines of the first group present in every group (multiset), in the first group's order."""
    budget = Counter(groups[0])
    for g in groups[1:]:
        budget &= Counter(g)
    out = []
    for line in groups[0]:
        if budget[line] > 0:
            budget[line] -= 1
            out.append(line)
    return out


def moved_lines(lines: list[str], static: list[str]) -> list[str]:
    """`lines` less the `static` ones (multiset): what static-first moves to the trailing turn."""
    budget = Counter(static)
    out = []
    for line in lines:
        if budget[line] > 0:
            budget[line] -= 1
        else:
            out.append(line)
    return out


def dynamic_block(stored: str, request: str) -> tuple[str, str] | None:
    """(the stored text's, the request's) differing block when the two agree again after it:
    a dynamic block inside static content (a date, an id). None when they never realign (the
    request goes on with other content: an order of schemas, another prompt)."""
    c = 0
    while c < min(len(stored), len(request)) and stored[c] == request[c]:
        c += 1
    s, r = stored[c:], request[c:]
    k = 0
    while k < min(len(s), len(r)) and s[len(s) - 1 - k] == r[len(r) - 1 - k]:
        k += 1
    if k < REALIGN_CHARS or c == len(stored) or c == len(request):
        return None
    # whole words: back to the space before the difference, on to the space after it
    a = c
    while a > 0 and not stored[a - 1].isspace():
        a -= 1
    ends = []
    for t in (stored, request):
        e = len(t) - k
        while e < len(t) and not t[e].isspace():
            e += 1
        ends.append(e)
    return stored[a : ends[0]].rstrip(".,;:"), request[a : ends[1]].rstrip(".,;:")


def suggestion(stored: str, request: str, entry: str, position: int) -> str:
    """What to change where a request differs from a stored prefix: static-first for a dynamic
    block inside static content, else keep that part of the prompt fixed."""
    block = dynamic_block(stored, request)
    if block is None:
        return (
            f"the prompt differs from {entry} at token {position} and goes on differently: keep "
            "what comes there in one fixed order and text (tool schemas, examples), or pin what "
            "the requests really share"
        )
    lines = [t.splitlines(keepends=True) for t in (stored, request)]
    moved = "".join(moved_lines(lines[1], static_lines(lines))).strip()
    if moved and request.rstrip().endswith(moved):  # its line goes on past the text kept
        moved += "..."
    return (
        f"static-first: {block[1]!r} (stored: {block[0]!r}) is dynamic inside static content; "
        f"keep the lines that are the same in every request in place and move {moved!r} into a "
        "trailing user turn (as `kvstore analyze` reorders), or keep it fixed"
    )
