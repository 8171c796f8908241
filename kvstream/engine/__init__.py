"""The transfer engine: a pure book of what is held, parts that act on it, the Agent."""
