# Shared helpers: config validation, the memopd command, per-rule code dependencies.
import json

from snakemake.utils import validate


validate(config, schema="../schemas/config.schema.yaml")

LOGS = "results/logs"
CPU_ENV = "../../envs/cpu.yaml"  # conda env of CPU steps (relative to workflow/rules/)


def cfg_json(*keys):
    """A config section as a JSON string for `memopd ... --cfg` (quote with {params.cfg:q})."""
    node = config
    for k in keys:
        node = node[k]
    return json.dumps(node, sort_keys=True)


def src(*modules):
    """Source files that a step depends on. Snakemake does not track imported modules, so a code
    change reruns the step only through these inputs."""
    return [f"src/memopd/{m}.py" for m in modules]
