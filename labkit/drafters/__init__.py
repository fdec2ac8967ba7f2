"""Drafters: everything that proposes tokens for the target to verify."""
from .base import Drafter, Proposal
from .draft_model import DraftModelDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "Proposal", "DraftModelDrafter", "PromptLookupDrafter"]
