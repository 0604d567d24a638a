"""Compiled helper kernels (cffi, API mode). Built by setup.py at install time."""
