"""Computing KV: prefill pins, warm a manifest, purge what no longer holds, the upgrade canary,
and import/export of mlx-lm prompt-cache files (checked by re-prefilling)."""
