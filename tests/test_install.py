"""specdraft installs as a package: the wheel carries the kernels (as `specdraft.kernels`, never as a
top-level `kernels` that would shadow the PyPI package transformers probes for), the recipes (as
`specdraft.recipes`) and the toy target, and works from any folder, not only inside a clone."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import importlib.util, specdraft.kernels; "
         "print(specdraft.kernels.__file__); print(importlib.util.find_spec('kernels'))")


def run_probe(cwd, env_path=None):
    env = {"PATH": "/usr/bin:/bin"}
    if env_path:
        env["PYTHONPATH"] = str(env_path)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return out.stdout.split("\n")


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    """The wheel, built offline from this checkout and installed (no dependencies) into a folder of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), "-q"], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("specdraft-*.whl")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return wheel, site


def test_editable_install_maps_kernels_under_specdraft(tmp_path):
    kernels_file, top_level = run_probe(tmp_path)[:2]
    assert Path(kernels_file) == REPO / "kernels" / "__init__.py"
    assert top_level == "None"


def test_wheel_ships_kernels_recipes_and_the_toy_target_under_specdraft(wheel_site, tmp_path):
    wheel, site = wheel_site
    names = zipfile.ZipFile(wheel).namelist()
    assert "specdraft/kernels/__init__.py" in names
    assert not any(n.startswith(("kernels/", "recipes/")) for n in names)
    shipped = {p.relative_to(REPO / "recipes").as_posix() for p in (REPO / "recipes").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert {f"specdraft/recipes/{name}" for name in shipped} <= set(names)  # every recipe, accelerate configs too
    assert "specdraft/toy_build/builder.py" in names and "specdraft/assets/toy_target/config.json" in names
    kernels_file, top_level = run_probe(tmp_path, env_path=site)[:2]
    assert Path(kernels_file) == site / "specdraft" / "kernels" / "__init__.py"
    assert top_level == "None"


def test_the_wheel_works_from_any_folder(wheel_site, tmp_path):
    """From a folder outside the clone: list and copy the shipped recipes, and train a shipped recipe
    by its bare name for 2 steps, with `specdraft` imported from the wheel."""
    _, site = wheel_site
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}

    def specdraft(*args):
        out = subprocess.run([str(site / "bin" / "specdraft"), *args], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    where = subprocess.run([sys.executable, "-c", "import specdraft; print(specdraft.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == site / "specdraft" / "__init__.py"  # the wheel's, not the checkout's
    listed = specdraft("recipes")
    assert "toy_eagle3" in listed and "llama3.1-8b-eagle3" in listed
    specdraft("recipes", "copy", "toy_eagle3", "mine.yaml")
    assert (work / "mine.yaml").read_text() == (REPO / "recipes" / "toy_eagle3.yaml").read_text()
    data = work / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write f{i} in x.py"},
                                                      {"role": "assistant", "content": f"def f{i}(x):\n    return x"}]})
                            + "\n" for i in range(12)))
    specdraft("train", "toy_eagle3", f"data.path={data}", "checkpoint.output_dir=run", "training.max_steps=2",
              "training.micro_batch_size=2", "data.max_length=64", "data.eval_fraction=0.2", "eval.enabled=false",
              "drafter.ttt_steps=2", "--no-progress")
    assert (work / "run" / "drafter" / "model.safetensors").is_file()
    recorded = (work / "run" / "recipe.yaml").read_text()
    assert "family: eagle3" in recorded and "max_steps: 2" in recorded
