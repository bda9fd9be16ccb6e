"""The wire tests (the daemon socket's framing and messages, both ends over a socketpair). Their
one fixture is in the file; shared ones are in tests/conftest.py."""
