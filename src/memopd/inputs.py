"""What a command checks before it loads or writes anything: its config sections and keys, its input files.

The errors here are the bad input `memopd` reports in one line with exit status 2 (memopd.cli.main); a
plain KeyError stays a bug with a traceback.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path


class UsageError(Exception):
    """Input the command cannot use (arguments that do not fit together, an input file of the wrong kind)."""


class ConfigError(UsageError, ValueError):
    """A config section or key that is missing or of the wrong type (also a ValueError, as config checks raise)."""


def section(cfg: dict, name: str, *keys: str) -> dict:
    """cfg[name], a mapping holding `keys`; else a ConfigError naming what is missing."""
    if name not in cfg:
        raise ConfigError(f"config has no section {name!r} (give --cfg with it)")
    node = cfg[name]
    if not isinstance(node, dict):
        raise ConfigError(f"config section {name!r} is a {type(node).__name__}, not a mapping")
    return require(node, *keys, where=name)


def require(cfg: dict, *keys: str, where: str = "") -> dict:
    """cfg itself once it holds every key of `keys`; else a ConfigError naming the missing ones."""
    missing = [k for k in keys if k not in cfg]
    if missing:
        place = f"config section {where!r}" if where else "config"
        keys = f"key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
        raise ConfigError(f"{place} has no {keys} (give --cfg with it)")
    return cfg


def existing(*paths) -> None:
    """Refuse a missing input file or directory before anything loads (None: an option not given)."""
    for p in paths:
        if p is not None and not Path(p).exists():
            raise FileNotFoundError(errno.ENOENT, "no such file", str(p))


def parse_cfg(text: str, flag: str = "--cfg") -> dict:
    """The JSON object a command's `flag` (--cfg, or another JSON option) holds."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{flag} must be a JSON object, not a {type(cfg).__name__}")
    return cfg


def one_line(e: Exception) -> str:
    """The message of a bad-input error on one line (a config check may list several problems, one a line)."""
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"no such file: {e.filename}"
    first, *rest = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
    return f"{first} {'; '.join(rest)}".strip()
