"""The one error type of the pretrained-folder tools."""

from __future__ import annotations


class PretrainedError(ValueError):
    """A pretrained folder (or an export target) is unusable; the message names the file or tensor."""
