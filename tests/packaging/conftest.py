"""Packaging: what the wheel installs (one top-level package) and that it lives beside others."""
