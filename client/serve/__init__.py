"""`kvstore serve`: mlx-lm's own OpenAI-compatible server with the persistent prompt cache."""
