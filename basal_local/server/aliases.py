"""Model aliases: `jev-latest` (the clients' default name) and `[aliases]` from config.toml.

An alias is one more name a request's `model` may use; it resolves to a served model before routing,
so the answer and the statistics carry the served name.
"""

from __future__ import annotations

CLIENT_DEFAULT = "jev-latest"  # typesafe-sdk, jevclient and jev-cli send this when the user names no model


def resolve_aliases(configured: dict[str, str], served: list[str], default: str) -> dict[str, str]:
    """alias -> served name; `jev-latest` -> the default model unless configured or served under that name."""
    aliases: dict[str, str] = {}
    if CLIENT_DEFAULT not in served:
        aliases[CLIENT_DEFAULT] = default
    for alias, target in configured.items():
        if alias in served:
            raise ValueError(f"config.toml [aliases]: {alias!r} is already the name of a served model")
        if target not in served:
            raise ValueError(f"config.toml [aliases]: {alias!r} points at {target!r}, which is not served "
                             f"(served: {', '.join(served)})")
        aliases[alias] = target
    return aliases

