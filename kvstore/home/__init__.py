"""The files of a home: its settings (settings.toml, where the home is), the prefill ledger, the
tombstones of evictions and the manifest registry. Below the store: the store imports only
home.settings."""
