"""The embstore command-line tools."""
