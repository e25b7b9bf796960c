"""Config layers (config/README.md): a file names its `base` and the keys it `drop`s; the scale overlays state only
what they change; the workflow builds the same config from them as `memopd plan --config` does."""
import subprocess
import sys

import pytest
import yaml

from agent_support import ROOT
from memopd.inputs import UsageError
from memopd.schema import merge_files, validate

OVERLAYS = ["small", "paper", "smoke", "cpu_full"]


def _write(tmp_path, name, data):
    (tmp_path / name).write_text(yaml.safe_dump(data))
    return tmp_path / name


def test_a_layer_merges_over_its_base_without_what_it_drops(tmp_path):
    _write(tmp_path, "base.yaml", {"a": {"x": 1, "y": 2, "w": {"p": 1, "q": 2}}, "l": [1, 2], "k": 3, "gone": 1})
    over = _write(tmp_path, "over.yaml", {"base": "base.yaml", "drop": {"a": {"y": None, "w": ["q"]}, "gone": None},
                                          "a": {"z": 4}, "l": [9]})
    top = _write(tmp_path, "top.yaml", {"k": 5, "a": {"x": None}})
    expected = {"a": {"x": None, "z": 4, "w": {"p": 1}}, "l": [9], "k": 5}
    assert merge_files([over, top]) == expected
    # the base loads once, under its layer: naming it again after the layer does not undo the layer
    assert merge_files([tmp_path / "base.yaml", over, top]) == expected
    assert merge_files([over, tmp_path / "base.yaml", top]) == expected
    assert merge_files([tmp_path / "base.yaml"])["a"]["y"] == 2


def test_a_bad_layer_is_one_error_naming_it(tmp_path):
    _write(tmp_path, "base.yaml", {"a": {"x": 1}})
    typo = _write(tmp_path, "typo.yaml", {"base": "base.yaml", "drop": {"a": ["y"]}})
    with pytest.raises(UsageError, match=r"typo\.yaml: drop\.a: drop names 'y'"):
        merge_files([typo])
    loop = _write(tmp_path, "loop.yaml", {"base": "loop.yaml"})
    with pytest.raises(UsageError, match="leads back to itself"):
        merge_files([loop])
    orphan = _write(tmp_path, "orphan.yaml", {"base": "missing.yaml"})
    with pytest.raises(UsageError, match="no such file"):
        merge_files([orphan])


def _restated(layer, base, path=()):
    """Leaves of `layer` equal to `base`'s at the same place (a plain walk over the two files)."""
    out = []
    for key, value in layer.items():
        if key not in base:
            continue
        if isinstance(value, dict) and isinstance(base[key], dict):
            out += _restated(value, base[key], path + (key,))
        elif value == base[key]:
            out.append(".".join(map(str, path + (key,))))
    return out


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_scale_overlay_states_only_its_changes(name):
    layer = yaml.safe_load((ROOT / f"config/{name}.yaml").read_text())
    base = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    assert layer.pop("base") == "config.yaml"
    layer.pop("drop", None)
    assert _restated(layer, base) == []
    validate(merge_files([ROOT / f"config/{name}.yaml"]))


def test_the_workflow_layers_as_memopd_does():
    """smoke.yaml drops the pretrained base model: the workflow trains the tokenizer and never builds the base."""
    r = subprocess.run([sys.executable, "-m", "snakemake", "--configfile", "config/smoke.yaml", "-n", "all", "--quiet",
                        "rules"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rules = {line.split()[0] for line in r.stdout.splitlines() if len(line.split()) == 2}
    assert "tokenizer" in rules and "model_base" not in rules, sorted(rules)
    cfg = merge_files([ROOT / "config/smoke.yaml"])
    assert "base" not in cfg["models"] and "pretrained" not in cfg["models"]["student"]
