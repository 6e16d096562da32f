"""pyml's version: here, below every layer, so that reports and commands name it without
importing the top package (pyproject.toml reads it from this file too)."""

__version__ = "0.1.0"
