"""The thin kvstore client: hydrate stored prefix caches into mlx-lm's LRUPromptCache."""

from client.hydrate import HydrateReport, hydrate

__all__ = ["HydrateReport", "hydrate"]
