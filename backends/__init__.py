"""Storage backends, one per module; the registry (embstore.registry) finds them by name."""
