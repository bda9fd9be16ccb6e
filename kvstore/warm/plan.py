"""A model's warm plan: its fingerprint and template hash, and each pin rendered, keyed and found
present or missing in the store (`kvstore.warm.warm.plan_model` makes it; warming, purging and the
fleet tier read it)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.identity.fingerprint import Fingerprint
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
    model_dir: Path
    fingerprint: Fingerprint
    template_hash: bytes
    pins: list[PlannedPin] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (pin name, why): this pin only
    day: dt.date | None = None  # the local date the pins were rendered for
    # the longest prefix the model takes, and where that limit is set (None: unknown)
    context: tuple[int, str] | None = None
