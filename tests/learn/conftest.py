"""The learning policy (kvstore.learned.policy): which prefixes are learned, what is wanted,
budgets."""
