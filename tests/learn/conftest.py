"""The learning policy (kvstore.learn): which prefixes are learned, what is wanted, budgets."""
