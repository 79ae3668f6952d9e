"""The Basal prompt and decision contract (docs/PROTOCOL.md §3-§5): no HTTP, no tensors."""
