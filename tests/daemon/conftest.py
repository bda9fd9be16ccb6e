"""The daemon tests (the socket server, the writer, boot warm, the watcher, the midnight re-warm,
exit statuses, the service files). Each starts its daemon as a real process (helpers.Proc);
fixtures used by one file stay in that file, shared ones are in tests/conftest.py."""
