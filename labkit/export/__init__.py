"""Heads trained here, written in the formats the serving engines load, and read back from them."""
