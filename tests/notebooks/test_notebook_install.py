"""The install cell at the top of notebooks/quickstart.ipynb: a no-op where gpt2core imports; elsewhere one pip
command whose CUDA extra (the plugin gpt2core-cuda12 / gpt2core-cuda13) follows the driver's CUDA version (nvidia-smi),
or from a checkout the CPU package and then that plugin, built for the GPU's arch. nvidia-smi is a stand-in script on
PATH; pip is recorded, not run."""
import importlib.util
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

CELLS = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb").read_text())["cells"]
CELL = "".join(next(c for c in CELLS if c.get("id") == "install")["source"])


def run_cell(monkeypatch, tmp_path, smi_output=None, installed=False, checkout=False):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if smi_output is not None:
        smi = bindir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n"  # sh builtins only: PATH holds nothing else
                       f"case \"$1\" in --query-gpu=compute_cap) echo 7.5;; *) echo '{smi_output}';; esac\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bindir))
    if not installed:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    pips, real_run = [], subprocess.run

    def fake_run(cmd, **kw):
        if "pip" in cmd:
            pips.append((cmd, kw.get("env") or {}))
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real_run(cmd, **kw)
    monkeypatch.setattr(subprocess, "run", fake_run)
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: checkout if p == "/content/gpt2core" else real_isdir(p))
    exec(compile(CELL, "install-cell", "exec"), {})
    return pips


def test_the_install_cell_comes_first():
    assert [c.get("id") for c in CELLS if c["cell_type"] == "code"][0] == "install"


def test_cell_is_a_no_op_where_gpt2core_imports(monkeypatch, tmp_path):
    assert "pip" in CELL and run_cell(monkeypatch, tmp_path, "CUDA Version: 12.4", installed=True) == []


@pytest.mark.parametrize("driver, extra", [("12.4", "[cuda12]"), ("13.0", "[cuda13]")])
def test_extra_follows_the_driver_and_the_build_targets_the_gpu(monkeypatch, tmp_path, driver, extra):
    smi = f"| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {driver}     |\n| Tesla T4 ..."
    (cmd, env), = run_cell(monkeypatch, tmp_path, smi)
    assert cmd[1:4] == ["-m", "pip", "install"] and cmd[-1].endswith("gpt2core" + extra), cmd
    assert env["GPT2CORE_CUDA_ARCHS"] == "75"


@pytest.mark.parametrize("driver, major", [("12.4", "12"), ("13.0", "13")])
def test_from_a_checkout_the_cpu_package_then_the_drivers_plugin(monkeypatch, tmp_path, driver, major):
    smi = f"| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {driver}     |"
    (cpu, cpu_env), (plugin, plugin_env) = run_cell(monkeypatch, tmp_path, smi, checkout=True)
    # the CPU package without a CUDA module of its own (a toolkit found would build one), then the plugin built
    # for the driver's CUDA major (plugins/cudaN/pyproject.toml fixes the major) and this GPU's arch
    assert cpu[-1] == "/content/gpt2core" and cpu_env["GPT2CORE_CUDA"] == "OFF"
    assert plugin[-1] == f"/content/gpt2core/plugins/cuda{major}" and plugin_env["GPT2CORE_CUDA_ARCHS"] == "75"
    assert "GPT2CORE_CUDA" not in plugin_env or plugin_env["GPT2CORE_CUDA"] != "OFF"


def test_the_cell_says_what_it_chose(monkeypatch, tmp_path, capsys):
    run_cell(monkeypatch, tmp_path, "| Driver Version: 550.54.15   CUDA Version: 12.4 |")
    assert ("NVIDIA driver for CUDA 12.4: installing gpt2core[cuda12], CUDA code built for CUDA 12 and sm_75 only"
            in capsys.readouterr().out)


def test_without_a_gpu_it_installs_the_cpu_package(monkeypatch, tmp_path):
    monkeypatch.delenv("GPT2CORE_CUDA_ARCHS", raising=False)
    (cmd, env), = run_cell(monkeypatch, tmp_path, smi_output=None)
    assert cmd[-1].endswith("gpt2core") and "GPT2CORE_CUDA_ARCHS" not in env
