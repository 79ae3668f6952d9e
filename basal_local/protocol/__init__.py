"""The Basal prompt and decision contract (PROTOCOL.md §3-§5): no HTTP, no tensors."""
