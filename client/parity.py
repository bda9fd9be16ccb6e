"""`kvstore parity`: greedy outputs with the hydrated store vs without it, prompt by prompt.

A gate for stored entries: a prompt that continues a pin is generated greedily twice, once from
the entry hydrated out of the store and once from a fresh prefill, and the tokens and the raw
logits of every step are compared. Any token mismatch, or a logit difference over `atol`, fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.identity.model import ModelIdentity
from kvstore.jsonl import read_objects

if TYPE_CHECKING:
    from kvstore.pins.manifest import Manifest

MAX_TOKENS = 16  # greedy steps per prompt
# Default reference "split" repeats the store's arithmetic exactly (same prefill chunks), so an
# honest entry gives identical logits and a tight tolerance catches any damage to the KV.
ATOL = 1e-3
REFERENCES = ("split", "whole")
MODEL_KEY = "parity"


class ParityError(KVStoreError):
    """A prompts file or a manifest cannot be used for a parity run."""


@dataclass(frozen=True)
class ParityPrompt:
    name: str  # the stage, or "line N"
    line: int
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    text: str | None = None
    model: str | None = None


@dataclass
class PromptResult:
    name: str
    line: int
    model: str
    prompt_tokens: int
    served: int  # tokens served from the store
    divergence: int | None  # first generated step where the tokens differ
    max_logit_diff: float  # over the steps both runs share a history
    tokens: list[int] = field(default_factory=list)  # with the store
    reference: list[int] = field(default_factory=list)  # without it
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


@dataclass
class ParityReport:
    results: list[PromptResult]
    atol: float
    reference: str
    warnings: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[PromptResult]:
        return [r for r in self.results if not r.ok]

    def to_json(self) -> dict[str, Any]:
        return dict(
            atol=self.atol,
            reference=self.reference,
            warnings=self.warnings,
            ok=not self.failed,
            results=[asdict(r) | {"ok": r.ok} for r in self.results],
        )


def load_prompts(path: str | Path) -> list[ParityPrompt]:
    """Read a JSONL file of {"messages": [...], "tools"?, "stage"?, "model"?} (or "text")."""
    path = Path(path)
    out = []
    for n, obj in read_objects(path, ParityError, "prompts"):
        if not (isinstance(obj.get("messages"), list) or isinstance(obj.get("text"), str)):
            raise ParityError(f'{path}:{n}: needs a "messages" list (or a "text" string)')
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ParityError(f'{path}:{n}: "tools" must be a list of tool schemas')
        out.append(
            ParityPrompt(
                str(obj.get("stage") or f"line {n}"),
                n,
                obj.get("messages"),
                tools,
                obj.get("text"),
                obj.get("model"),
            )
        )
    if not out:
        raise ParityError(f"{path}: no prompts")
    return out


def prompt_tokens(tokenizer: Any, prompt: ParityPrompt) -> list[int]:
    """Tokens as mlx_lm.server / generate build them: template with the generation prompt."""
    if prompt.text is not None:
        return list(tokenizer.encode(prompt.text))
    text = tokenizer.apply_chat_template(
        prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def greedy(
    model: Any,
    tokens: list[int],
    cache: list,
    *,
    max_tokens: int,
    identity: ModelIdentity | None = None,
) -> tuple[list[int], list]:
    """Greedy tokens and the raw logits of every step (mlx-lm's generate_step, default sampler),
    the KV quantized as `identity` says."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    logits: list = []

    def record(_history: Any, step_logits: Any) -> Any:
        logits.append(step_logits.astype(mx.float32))
        return step_logits

    quant = identity or ModelIdentity("")  # none: generate's defaults, KV not quantized
    out = []
    for token, _ in generate_step(
        mx.array(tokens),
        model,
        max_tokens=max_tokens,
        prompt_cache=cache,
        logits_processors=[record],
        kv_bits=quant.kv_bits,
        kv_group_size=quant.kv_group_size,
        quantized_kv_start=quant.quantized_kv_start,
    ):
        out.append(int(token))
    return out, logits


@dataclass(frozen=True)
class Comparison:
    divergence: int | None  # first generated step where the tokens differ
    max_logit_diff: float  # largest |logit difference| over the steps with a shared history
    worst_step: int  # the step where it occurs


def compare(a: tuple[list[int], list], b: tuple[list[int], list]) -> Comparison:
    """Compare two (tokens, logits) runs of `greedy`."""
    import mlx.core as mx

    (ta, la), (tb, lb) = a, b
    divergence = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if divergence is None and len(ta) != len(tb):
        divergence = min(len(ta), len(tb))
    # Past the divergence the histories differ, so their logits say nothing about the entry.
    last = len(la) if divergence is None else divergence + 1
    diffs = [mx.max(mx.abs(x - y)).item() for x, y in zip(la[:last], lb[:last])]
    if not diffs:
        return Comparison(divergence, 0.0, 0)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return Comparison(divergence, diffs[worst], worst)


def _model_for(prompt: ParityPrompt, models: list) -> int:
    if prompt.model is None:
        if len(models) != 1:
            raise ParityError(
                f"prompt {prompt.name!r} (line {prompt.line}): the manifest has "
                f'{len(models)} models; add "model" to the line'
            )
        return 0
    for i, spec in enumerate(models):
        if prompt.model in (spec.path, Path(spec.path).name):
            return i
    raise ParityError(
        f"prompt {prompt.name!r} (line {prompt.line}): model {prompt.model!r} "
        "is not in the manifest"
    )


def run_parity(
    manifest: Manifest,
    prompts: list[ParityPrompt],
    *,
    home: Path,
    max_tokens: int = MAX_TOKENS,
    atol: float = ATOL,
    reference: str = "split",
) -> ParityReport:
    """Run every prompt with the hydrated store and without it; see the module docstring."""
    from mlx_lm import load
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    from kvstore.client.hydrate import insert, prefetch
    from kvstore.identity.fingerprint import resolve_model_path
    from kvstore.kvcheck.prefill import prefill

    if reference not in REFERENCES:
        raise ParityError(f"reference must be one of {', '.join(REFERENCES)}")
    report = ParityReport([], atol, reference)
    models = list(manifest.models)
    by_model: dict[int, list[ParityPrompt]] = {}  # index: specs hold dicts, so are unhashable
    for p in prompts:
        by_model.setdefault(_model_for(p, models), []).append(p)
    for index, group in by_model.items():
        spec = models[index]
        # loaded and hydrated without the manifest's model_config overrides, as before
        identity = replace(spec.identity, model_config=None)
        model, tokenizer = load(
            str(resolve_model_path(identity.path)), adapter_path=identity.adapter
        )
        lru = LRUPromptCache(max_size=1 << 20)  # hold every entry: nothing may drop silently
        hyd = insert(lru, MODEL_KEY, prefetch(identity, home=home, model=model), model=model)
        if hyd.warning:
            report.warnings.append(hyd.warning)
        for p in group:
            tokens = prompt_tokens(tokenizer, p)
            cache, rest = lru.fetch_nearest_cache(MODEL_KEY, tokens)
            served = len(tokens) - len(rest)
            result = PromptResult(p.name, p.line, spec.path, len(tokens), served, None, 0.0)
            report.results.append(result)
            if cache is None or not rest:
                result.problem = (
                    "no stored entry serves this prompt (run `kvstore warm`, and "
                    "check that the prompt continues a pin)"
                    if cache is None
                    else "the prompt is exactly a stored prefix; add a user turn"
                )
                continue
            if reference == "split":
                ref_cache = prefill(model, tokens[:served], identity=identity)
                ref_prompt = rest
            else:
                ref_cache, ref_prompt = make_prompt_cache(model), tokens
            hydrated = greedy(model, rest, cache, max_tokens=max_tokens, identity=identity)
            cold = greedy(model, ref_prompt, ref_cache, max_tokens=max_tokens, identity=identity)
            result.tokens, result.reference = hydrated[0], cold[0]
            cmp = compare(hydrated, cold)
            result.divergence, result.max_logit_diff = cmp.divergence, cmp.max_logit_diff
            if result.divergence is not None:
                result.problem = (
                    f"greedy tokens diverge at generated token "
                    f"{result.divergence}: {hydrated[0][result.divergence :][:1]} "
                    f"with the store vs {cold[0][result.divergence :][:1]} without"
                )
            elif result.max_logit_diff > atol:
                result.problem = (
                    f"logits differ by {result.max_logit_diff:.3g} at generated "
                    f"token {cmp.worst_step} (over --atol {atol:g}); tokens agree"
                )
        del model
    return report


def _table(report: ParityReport) -> str:
    rows = [f"{'prompt':24} {'served':>13} {'divergence':>10} {'max|dlogit|':>11}  status"]
    for r in report.results:
        div = "none" if r.divergence is None else str(r.divergence)
        rows.append(
            f"{r.name[:24]:24} {f'{r.served}/{r.prompt_tokens}':>13} {div:>10} "
            f"{r.max_logit_diff:11.3g}  {'ok' if r.ok else 'FAIL'}"
        )
    return "\n".join(rows)
