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


def merge_files(paths) -> dict:
    """Config files merged in order as Snakemake merges --configfile (later keys win, mappings merged deep)."""
    def merge(a, b):
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}

    cfg: dict = {}
    for p in paths:
        cfg = merge(cfg, read_yaml(p))
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
