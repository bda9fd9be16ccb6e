"""Cache objects <-> bytes: mlx-lm prompt-cache safetensors, validated before mlx sees a byte.

`codec` encodes and decodes (its `decode` reads top to bottom); the steps of a decode each have
their module: `safetensors` (the byte layout, pure Python), `cache_state` (the cache structure
and class allowlist), `materialize` (the one copy of stored bytes into mlx memory), and
`cache_api` (the installed mlx-lm's cache objects <-> the one stored form, 0.31 or 0.32).
"""

# The byte layout's version: every entry records it and every fingerprint folds it in. Here, not
# in codec.py, so the fingerprint and the store read it without importing mlx.
CODEC_VERSION: int = 1


def idle_cores() -> int:
    """Cores this process may run on that nothing runs on now, by the 1-minute load average,
    rounded (KVSTORE_IDLE_CORES sets it, for measuring). A hydrate beside the weight load pays off
    only on an idle core: on busy ones the two threads share a core and the GIL."""
    import os

    forced = os.environ.get("KVSTORE_IDLE_CORES", "")
    if forced.isdigit():
        return int(forced)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        return cores - 1
    return max(0, int(cores - busy + 0.5))
