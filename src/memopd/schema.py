"""The workflow's config schema (workflow/schemas/config.schema.yaml, which Snakemake validates every run
against) applied outside Snakemake: a command that reads config files itself (`memopd plan --config`) refuses what
the workflow would refuse, in one line, before it computes or writes anything."""
from __future__ import annotations

from pathlib import Path

from memopd.inputs import UsageError

SCHEMA = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


def read_yaml(path: str | Path) -> dict:
    """A config file's mapping; a missing file, malformed YAML or a top level that is not a mapping: UsageError
    naming the file (and the line)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UsageError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a config file is a mapping of sections, not a {type(data).__name__}")
    return data


LAYER_KEYS = ("base", "drop")  # a layer's directives (config/README.md), not config keys


def merge(a: dict, b: dict) -> dict:
    """`b` over `a` as Snakemake merges config files: later keys win, mappings merged deep, anything else whole."""
    return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


def drop(cfg: dict, spec, where: str) -> dict:
    """`cfg` without the keys `spec` names: a list of keys, or a mapping from a key to the spec of its value. A key
    that is not there is a UsageError naming `where` (a drop that removes nothing is a typo)."""
    names = spec if isinstance(spec, list) else list(spec)
    for name in names:
        if not isinstance(cfg, dict) or name not in cfg:
            raise UsageError(f"{where}: drop names {name!r}, which the layers below do not set")
    out = dict(cfg)
    for name in names:
        inner = spec[name] if isinstance(spec, dict) else None
        if inner is None:
            del out[name]
        else:
            out[name] = drop(cfg[name], inner, f"{where}.{name}")
    return out


def layer_stack(paths) -> list[Path]:
    """The files in merge order: each after its `base` (a path relative to the file, loaded once, before it)."""
    stack: list[Path] = []

    def add(path: Path, seen: tuple) -> None:
        base = read_yaml(path).get("base")  # a missing file is named as given
        if path.resolve() in seen:
            raise UsageError(f"{path}: its base leads back to itself")
        if base is not None:
            add(path.parent / str(base), seen + (path.resolve(),))
        if path.resolve() not in {p.resolve() for p in stack}:
            stack.append(path)

    for p in paths:
        add(Path(p), ())
    return stack


def merge_files(paths) -> dict:
    """Config files merged in order as Snakemake merges --configfile (later keys win, mappings merged deep), each
    layer over its `base` and without the keys its `drop` removes from the layers below (config/README.md)."""
    cfg: dict = {}
    for path in layer_stack(paths):
        data = read_yaml(path)
        if "drop" in data:
            cfg = drop(cfg, data["drop"], f"{path}: drop")
        cfg = merge(cfg, {k: v for k, v in data.items() if k not in LAYER_KEYS})
    return cfg


def validate(cfg: dict, schema: str | Path = SCHEMA) -> None:
    """UsageError naming the first place where `cfg` breaks the schema (its key path, what is wrong)."""
    import jsonschema
    import yaml

    schema = Path(schema)
    if not schema.is_file():
        raise UsageError(f"the config schema {schema} is missing (run from a checkout of the repository)")
    spec = yaml.safe_load(schema.read_text())
    validator = jsonschema.validators.validator_for(spec)(spec)
    error = jsonschema.exceptions.best_match(validator.iter_errors(cfg))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise UsageError(f"config {where}: {error.message}")
