"""The `kvstore` command line (click). Commands that touch no KV bytes import no mlx."""
