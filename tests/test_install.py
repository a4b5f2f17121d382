"""`kernels/` installs as `specdraft.kernels`, never as a top-level `kernels` that would shadow the
PyPI package transformers probes for: checked for the editable install and for a built wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import importlib.util, specdraft.kernels; "
         "print(specdraft.kernels.__file__); print(importlib.util.find_spec('kernels'))")


def run_probe(cwd, env_path=None):
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = str(env_path)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\n")


def test_editable_install_maps_kernels_under_specdraft(tmp_path):
    kernels_file, top_level = run_probe(tmp_path)[:2]
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert top_level == "None"


def test_wheel_ships_kernels_under_specdraft(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), "-q"], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("specdraft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "specdraft/kernels/__init__.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    kernels_file, top_level = run_probe(tmp_path, env_path=site)[:2]
    assert Path(kernels_file) == site / "specdraft" / "kernels" / "__init__.py"
    assert top_level == "None"
