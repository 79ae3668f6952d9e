"""The engine: planning, prefix-tree packing and scheduling. Backend-neutral; no HTTP, no frameworks."""
