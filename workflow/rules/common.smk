# Shared helpers: config validation, the memopd command, per-rule code dependencies.
import json
import os
import sys

from snakemake.utils import validate


validate(config, schema="../schemas/config.schema.yaml")

# Jobs call `memopd`: find the one installed beside the Python running Snakemake (.venv/bin), so
# `.venv/bin/snakemake ...` works without activating the venv. A conda env, when used, comes first.
envvars:
    "PATH",


_venv_bin = os.path.dirname(sys.executable)
os.environ.update(PATH=_venv_bin + os.pathsep + os.environ["PATH"])

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
