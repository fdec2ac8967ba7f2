"""Presentation: coloured tokens, plots, tree drawings and notebook widgets."""
