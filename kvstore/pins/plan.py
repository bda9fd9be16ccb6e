"""A model's warm plan: the model located (its directory, config and template hash, read once:
`kvstore.identity.model.ResolvedModel`), its fingerprint, and each pin rendered, keyed and found
present or missing in the store (`kvstore.warm.warm.plan_model` makes it; warming, purging and the
fleet tier read it)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.identity.fingerprint import Fingerprint
from kvstore.identity.model import ResolvedModel
from kvstore.pins.manifest import ModelSpec, PrefixSpec
from kvstore.pins.render import RenderedPin


@dataclass
class PlannedPin:
    model: ModelSpec
    pin: RenderedPin
    key: bytes
    present: bool
    prefix: PrefixSpec | None = None


@dataclass
class ModelPlan:
    spec: ModelSpec
    model: ResolvedModel  # the spec's identity located: every step of the warm reads it here
    fingerprint: Fingerprint
    pins: list[PlannedPin] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (pin name, why): this pin only
    day: dt.date | None = None  # the local date the pins were rendered for
    # the longest prefix the model takes, and where that limit is set (None: unknown)
    context: tuple[int, str] | None = None

    @property
    def model_dir(self) -> Path:
        """Where the model resolved (read once, when planned)."""
        return self.model.directory

    @property
    def template_hash(self) -> bytes:
        return self.model.template_hash
