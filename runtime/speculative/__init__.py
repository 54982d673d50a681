"""Speculative decoding: drafters propose tokens, the target verifies them all in one pass."""

from __future__ import annotations

from plait.runtime.speculative.base import DraftContext, Drafter, create_drafter, register_drafter
from plait.runtime.speculative.verify import verify_draft

__all__ = ["DraftContext", "Drafter", "create_drafter", "register_drafter", "verify_draft"]
