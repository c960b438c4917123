"""For tests and Python-layer authors: the numerical gradient checker."""
