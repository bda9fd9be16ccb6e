"""What to pin: the manifest, the registered manifests, and rendering a pin to its stable
boundary."""
