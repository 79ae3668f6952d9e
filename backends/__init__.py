"""Compute backends behind one small Protocol (DESIGN.md "The Backend protocol")."""
