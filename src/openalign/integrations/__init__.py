"""Adapters that let other projects' tools drive openalign models with their own code."""
