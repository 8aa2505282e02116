"""Interop with other frameworks (e.g. run a Flower NumPyClient as a fedtrain task)."""
