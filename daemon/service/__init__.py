"""`kvstore service`: the daemon as a launchd LaunchAgent (macOS) or a systemd user unit (Linux)."""
