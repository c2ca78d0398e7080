"""Exceptions of the auditor library. The CLI turns them into one-line errors; nothing else should."""

from __future__ import annotations


class AuditorError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class ConfigError(AuditorError):
    """A configuration value is unknown or invalid."""


class StoreError(AuditorError):
    """The database cannot be opened, read, or written as needed."""
