"""Config keys checked against their schema, and the error a config that cannot run raises: shared by every
entry point (prep, training, the plan, evaluation).

Hydra's `+key=value` opens a structured config's struct flag, so an appended key would slip past the schema and
its default be used silently: `check_keys` refuses it with the closest known key. A key that was renamed or
replaced is refused naming what to use instead, on the command line before Hydra composes (`refuse_renamed`) and
in a composed config (`check_keys`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration that composes but cannot run; the message names the key."""


def refuse_renamed(overrides: list[str], renamed: dict[str, str], replaced: dict[str, str] | None = None) -> None:
    """ConfigError for a command-line override (`key=value`, `+key=value`, `~key`) of a renamed key, before
    Hydra composes anything (whose own error would only say the key is unknown)."""
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in (replaced or {}):
            raise ConfigError(f"'{key}' is no longer read: {replaced[key]}")  # type: ignore[index]
        if key in renamed:
            value = arg.split("=", 1)[1] if "=" in arg else "..."
            raise ConfigError(f"'{key}' is now '{renamed[key]}': pass {renamed[key]}={value}")


def check_keys(node: Any, schema: type, prefix: str = "", renamed: dict[str, str] | None = None,
               replaced: dict[str, str] | None = None) -> None:
    """ConfigError for a key of `node` that `schema` (a dataclass, nested) lacks, with the closest known key
    (a key of `renamed`, full dotted name -> its new name: that name; of `replaced`, full dotted name -> what
    replaced it: that). Hydra's `+key=value` opens the struct flag, so an appended key slips past the schema
    otherwise (and the default is silently used). Shared by prep and train."""
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        full = f"{prefix}{key}"
        if full in (replaced or {}):
            raise ConfigError(f"'{full}' is no longer read: {replaced[full]}")  # type: ignore[index]
        if full in (renamed or {}):
            raise ConfigError(f"'{full}' is now '{renamed[full]}'")  # type: ignore[index]
        if not dataclasses.is_dataclass(schema):
            continue  # below a known key that is no section: an old section's keys are checked above only
        known = {f.name: f for f in dataclasses.fields(schema)}
        if key not in known:
            # a section that moved away: its keys' own messages first (capture.vllm.python -> vllm.python)
            check_keys(value, None, f"{full}.", renamed, replaced)  # type: ignore[arg-type]
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {sorted(known)}"
            raise ConfigError(f"unknown config key '{full}' (not in {schema.__name__}){hint}")
        check_keys(value, typing.get_type_hints(schema)[key], f"{full}.", renamed, replaced)
