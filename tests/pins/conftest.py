"""Fixtures of the pin tests (manifests, rendering, the registry, the chat-template battery)."""

from __future__ import annotations

import pytest
from template_families import FamilyModels


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> FamilyModels:
    """Each family's tiny model (and loaded TokenizerWrapper), built once per session on demand."""
    return FamilyModels(tmp_path_factory.mktemp("family_models"))
