"""Admission and eviction policies, one per module; found by name through embstore.registry."""
