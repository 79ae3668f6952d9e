"""Compute backends behind one small Protocol (docs/ARCHITECTURE.md "Torch backend")."""
