"""Which stored entries no longer hold for a manifest: what its warm purges, or releases (only
its ownership goes when other owners keep the entry)."""

from __future__ import annotations

from kvstore.identity.model import ModelIdentity
from kvstore.pins.manifest import Manifest, ModelSpec
from kvstore.pins.ownership import manifest_owner, owners, released
from kvstore.pins.plan import ModelPlan
from kvstore.store.store import Store
from kvstore.wire.messages import Purged


def stale_pins(manifest: Manifest, store: Store, plans: dict[tuple, ModelPlan]) -> list[Purged]:
    """Entries that no longer hold for this manifest: its pins whose model changed, that were
    removed or re-rendered to other tokens, whose chat template changed, or whose model left the
    manifest; and any entry (a runtime pin, a chain, an import) of one of its models that was
    stored under an older fingerprint of that model."""
    out = []
    me = manifest_owner(manifest.path)
    planned = {pp.key for plan in plans.values() for pp in plan.pins}
    # A model that does not resolve (a path mid-edit, a typo) may be the new name of any model the
    # manifest no longer names: nothing of those is purged until it resolves.
    unresolved = [s.path for s in manifest.models if s.identity.same_model() not in plans]
    for meta in store.metas(errors=[]):
        plan = plans.get(ModelIdentity.of_entry(meta).same_model())
        ours = me in owners(meta)
        if not ours:
            if plan is not None and meta.fingerprint != plan.fingerprint.digest:
                out.append(
                    Purged(
                        meta.key.hex(),
                        meta.label,
                        meta.model,
                        "model changed (weights, config or adapter)",
                    )
                )
            continue
        if plan is None:
            if any(
                s.identity.same_model() == ModelIdentity.of_entry(meta).same_model()
                for s in manifest.models
            ):
                continue  # its model failed to plan: keep what we have, do not guess
            if meta.key in planned:
                continue  # the same KV under the model's new name: re-owned (moved_pins)
            if unresolved:
                continue  # kept until the manifest's models resolve (see above)
            cause = "model removed from the manifest"
        elif meta.fingerprint != plan.fingerprint.digest:
            cause = "model changed (weights, config or adapter)"
        elif meta.label in {name for name, _ in plan.failed}:
            continue  # this pin failed to render: keep what it had, do not guess
        elif _prepared_ahead(meta, plan):
            continue  # a clock-bound pin prepared for a later day: it is valid then
        elif meta.key not in {pp.key for pp in plan.pins}:
            cause = "pin removed, or its rendered tokens changed"
        elif meta.template_hash != plan.template_hash:
            cause = "chat template or tokenizer changed"
        else:
            continue
        # KV of an older fingerprint serves no one; anything else other owners may still want
        outdated = plan is not None and meta.fingerprint != plan.fingerprint.digest
        kept = not outdated and released(meta, me) is not None
        out.append(Purged(meta.key.hex(), meta.label, meta.model, cause, released=kept))
    return out


def _prepared_ahead(meta, plan: ModelPlan) -> bool:
    valid = meta.valid_date
    if valid is None or plan.day is None:
        return False
    return valid > plan.day.isoformat() and any(pp.pin.name == meta.label for pp in plan.pins)


def moved_pins(
    manifest: Manifest, store: Store, plans: dict[tuple, ModelPlan]
) -> dict[bytes, ModelSpec]:
    """This manifest's pins stored under a model name it no longer uses whose key (fingerprint and
    tokens) one of its models now has: the same KV (the model moved to an identical copy), to be
    re-owned under the new name rather than purged and prefilled again. An entry another manifest
    also owns keeps its name (that manifest may still use it)."""
    me = manifest_owner(manifest.path)
    specs = {pp.key: plan.spec for plan in plans.values() for pp in plan.pins}
    out = {}
    for meta in store.metas(errors=[]):
        spec = specs.get(meta.key)
        if spec is None or ModelIdentity.of_entry(meta).same_model() in plans:
            continue
        manifests = [o for o in owners(meta) if o.startswith("manifest:")]
        if manifests == [me]:
            out[meta.key] = spec
    return out
