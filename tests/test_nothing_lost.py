"""Nothing lost: what ``--overwrite``, ``--resume`` and a full disk must never do to the user's files.

The folder rules run through the real CLI (a fresh process, in a temporary working directory holding
sentinel files), and each test checks the sentinels and the old run survive byte for byte.
"""

import errno
import json
import os
import shutil
from pathlib import Path

import probe_family  # noqa: F401  (registers the "probe" family)
import pytest
import torch
import yaml

from specdraft import checkpoint as ckpt_module
from specdraft import train as train_module
from specdraft.checkpoint import checkpoint_dirs
from specdraft.config import parse_recipe
from specdraft.errors import SpecdraftError
from specdraft.run_folder import aside_path
from specdraft.train import train
from spine import make_chat_data, make_recipe, read_metrics, run_cli, write_recipe
from tiny import save_tiny_target


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by relative path: what must come out of a refused command unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny target, chat data and one finished 3-step probe run, built once."""
    root = tmp_path_factory.mktemp("nothing-lost")
    target = save_tiny_target(root / "target")
    data = make_chat_data(root / "chat.jsonl", n=16)
    raw = make_recipe(root, target, data, training={"max_steps": 3})
    train(parse_recipe(raw), show_progress=False)
    return root, raw


@pytest.fixture
def old_run(built, tmp_path):
    """A copy of the finished run in this test's folder, and its recipe pointing there."""
    root, raw = built
    shutil.copytree(root / "run", tmp_path / "run")
    raw = json.loads(json.dumps(raw))
    raw["checkpoint"]["output_dir"] = str(tmp_path / "run")
    return tmp_path / "run", raw


def cli_train(tmp_path: Path, raw: dict, *flags, cwd: Path | None = None, env: dict | None = None):
    recipe = write_recipe(tmp_path / "recipe.yaml", raw)
    return run_cli(["train", str(recipe), "--no-progress", *flags], cwd=cwd or tmp_path, env=env)


def assert_refused(out, message: str) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert message in out.stderr, out.stderr[-3000:]


# -- --overwrite refuses what it must never replace ----------------------------------------------------


def test_overwrite_of_the_working_directory_is_refused_and_deletes_nothing(built, tmp_path):
    _, raw = built
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("a user's file")
    shutil.copy(raw["data"]["path"], work / "chat.jsonl")
    before = snapshot(work)
    raw = {**raw, "data": {**raw["data"], "path": "chat.jsonl"}, "checkpoint": {**raw["checkpoint"], "output_dir": "."}}
    assert_refused(cli_train(tmp_path, raw, "--overwrite", cwd=work), "which is the working directory")
    assert snapshot(work) == before


def test_overwrite_of_a_folder_holding_the_data_and_another_run_is_refused(built, old_run, tmp_path):
    run_dir, raw = old_run
    data = run_dir / "chat.jsonl"  # the data lives inside the folder --overwrite would replace
    shutil.copy(raw["data"]["path"], data)
    raw["data"]["path"] = str(data)
    before = snapshot(run_dir)
    assert_refused(cli_train(tmp_path, raw, "--overwrite"), "holds this run's own input data.path")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("kind", ["not-a-run", "home", "foreign-file"])
def test_overwrite_replaces_only_a_run_folder(old_run, tmp_path, kind):
    run_dir, raw = old_run
    env = None
    if kind == "not-a-run":
        target = tmp_path / "photos"
        target.mkdir()
        (target / "holiday.jpg").write_bytes(b"\xff\xd8 pixels")
        message = "is not a specdraft run folder"
    elif kind == "home":
        target = tmp_path / "home"
        target.mkdir()
        (target / ".bashrc").write_text("export PATH")
        env = {"HOME": str(target)}
        message = "your home folder"
    else:
        target = run_dir
        (target / "notes.txt").write_text("what I learned from this run")
        message = "holds files specdraft did not write (notes.txt)"
    raw["checkpoint"]["output_dir"] = str(target)
    before = snapshot(target)
    assert_refused(cli_train(tmp_path, raw, "--overwrite", env=env), message)
    assert snapshot(target) == before


def test_overwrite_with_broken_data_keeps_the_old_run(old_run, tmp_path):
    """The data fails to parse only once the target has loaded: the old run must still be whole."""
    run_dir, raw = old_run
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null}]}\n')
    raw["data"]["path"] = str(broken)
    before = snapshot(run_dir)
    out = cli_train(tmp_path, raw, "--overwrite")
    assert_refused(out, "data record 0 (counting from 0): a assistant message has no content (null)")
    assert snapshot(run_dir) == before
    assert not aside_path(run_dir).exists()


def test_a_new_run_that_fails_before_its_first_checkpoint_gives_the_old_one_back(old_run, tmp_path):
    run_dir, raw = old_run
    before = snapshot(run_dir)
    raw["checkpoint"]["save_every"] = 100
    out = cli_train(tmp_path, raw, "--overwrite", env={"PROBE_NAN_AT_CALL": "3"})
    assert_refused(out, "loss is nan")
    assert "the run it was replacing is back" in out.stdout + out.stderr
    assert snapshot(run_dir) == before and not aside_path(run_dir).exists()


def test_overwrite_replaces_the_old_run_once_the_new_one_has_a_checkpoint(old_run, tmp_path):
    run_dir, raw = old_run
    old_weights = (checkpoint_dirs(run_dir)[-1] / "drafter" / "model.safetensors").read_bytes()
    raw["training"]["max_steps"] = 2
    raw["checkpoint"]["save_every"] = 1
    out = cli_train(tmp_path, raw, "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-0000001", "step-0000002"]
    assert (checkpoint_dirs(run_dir)[-1] / "drafter" / "model.safetensors").read_bytes() != old_weights
    assert not aside_path(run_dir).exists()


def test_a_kill_before_the_new_runs_first_checkpoint_loses_nothing(old_run, tmp_path):
    """kill -9 between the rename aside and the first checkpoint: the next start puts the old run back."""
    run_dir, raw = old_run
    before = snapshot(run_dir)
    raw["checkpoint"]["save_every"] = 100
    killed = cli_train(tmp_path, raw, "--overwrite", env={"PROBE_KILL_AT_CALL": "1"})
    assert killed.returncode == -9
    assert aside_path(run_dir).is_dir() and not checkpoint_dirs(run_dir)  # the state a kill leaves
    again = cli_train(tmp_path, raw)  # no flag: it restores, then says the run exists
    assert_refused(again, "already exists; pass --resume")
    assert "restored" in again.stdout
    assert snapshot(run_dir) == before and not aside_path(run_dir).exists()


# -- --resume refuses edits that change what is trained --------------------------------------------------


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["optimizer"].update(lr=5e-3), "optimizer.lr: 0.01 -> 0.005"),
    (lambda raw: raw["drafter"].update(draft_vocab_size=7), "drafter.draft_vocab_size: None -> 7"),
    (lambda raw: raw["training"].update(max_steps=2), "training.max_steps: 3 -> 2"),
    (lambda raw: raw["training"].update(seed=5), "training.seed: 0 -> 5"),
], ids=["lr", "shape", "max-steps-shrinks", "seed"])
def test_resume_refuses_recipe_edits_that_change_what_is_trained(old_run, monkeypatch, edit, message):
    run_dir, raw = old_run
    edit(raw)
    before = snapshot(run_dir)
    monkeypatch.setattr(train_module, "load_target", lambda *a, **k: pytest.fail("loaded before refusing"))
    with pytest.raises(SpecdraftError, match="--resume: the recipe differs") as error:
        train(parse_recipe(raw), resume=True, show_progress=False)
    assert message in str(error.value)
    assert snapshot(run_dir) == before  # recipe.yaml still records what was trained


def test_resume_applies_and_records_the_changes_it_may_make(old_run):
    run_dir, raw = old_run
    raw["training"].update(max_steps=5, log_every=2)
    train(parse_recipe(raw), resume=True, show_progress=False)
    (event,) = [m for m in read_metrics(run_dir) if m.get("event") == "resumed"]
    assert event["changed"] == {"training.max_steps": [3, 5], "training.log_every": [1, 2]}
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["training"]["max_steps"] == 5
    assert checkpoint_dirs(run_dir)[-1].name == "step-0000005"


def test_resume_refuses_data_whose_content_changed(built, tmp_path):
    root, raw = built
    data = shutil.copy(raw["data"]["path"], tmp_path / "chat.jsonl")
    raw = make_recipe(tmp_path, raw["target"]["path"], data, training={"max_steps": 3})
    train(parse_recipe(raw), show_progress=False)
    data.write_text(data.read_text().replace("fox", "cat"))  # same path, other content
    with pytest.raises(SpecdraftError, match=r"data.path \(.*chat.jsonl\) no longer holds the data"):
        train(parse_recipe(raw), resume=True, show_progress=False)


# -- a full disk --------------------------------------------------------------------------------------


def torch_save_failing_at(step_name: str):
    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if step_name in str(path) and str(path).endswith("scheduler.pt"):
            # what torch.save raises on ENOSPC: a RuntimeError, not an OSError
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 448: "
                               "PytorchStreamWriter failed writing file data/0: file write failed")
        return real_save(obj, path, *a, **k)

    return failing_save


def test_a_full_disk_inside_torch_save_leaves_no_temporary_folder(built, tmp_path, monkeypatch):
    _, raw = built
    raw = make_recipe(tmp_path, raw["target"]["path"], raw["data"]["path"], training={"max_steps": 6})
    monkeypatch.setattr(ckpt_module.torch, "save", torch_save_failing_at("step-0000006"))
    with pytest.raises(SpecdraftError, match=r"step-0000003 is intact\. A checkpoint needs about [\d.]+ KiB"):
        train(parse_recipe(raw), show_progress=False)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-0000003"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_a_checkpoint_is_refused_before_writing_when_the_disk_is_too_full(built, tmp_path, monkeypatch):
    _, raw = built
    raw = make_recipe(tmp_path, raw["target"]["path"], raw["data"]["path"], training={"max_steps": 3})
    written = []
    monkeypatch.setattr(ckpt_module.torch, "save", lambda obj, path, *a, **k: written.append(path))
    monkeypatch.setattr(ckpt_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 100))
    with pytest.raises(SpecdraftError, match="No space left on device: 100 B free.*no earlier checkpoint"):
        train(parse_recipe(raw), show_progress=False)
    assert written == [] and not list((tmp_path / "run" / "checkpoints").iterdir())


def test_a_full_disk_writing_the_final_drafter_names_the_checkpoint_and_resume_finishes(built, tmp_path, monkeypatch):
    _, raw = built
    raw = make_recipe(tmp_path, raw["target"]["path"], raw["data"]["path"], training={"max_steps": 3})
    real = train_module.atomic_folder

    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_module, "atomic_folder", full_disk)
    with pytest.raises(SpecdraftError, match=r"could not write the final drafter .*step-0000003 holds the same "
                                             r"weights.*--resume"):
        train(parse_recipe(raw), show_progress=False)
    monkeypatch.setattr(train_module, "atomic_folder", real)
    train(parse_recipe(raw), resume=True, show_progress=False)
    assert (tmp_path / "run" / "drafter" / "model.safetensors").read_bytes() == \
        (checkpoint_dirs(tmp_path / "run")[-1] / "drafter" / "model.safetensors").read_bytes()


# -- export and eval --out: --overwrite replaces only what the command wrote ------------------------


def run_main(argv: list[str], cwd: Path, monkeypatch) -> int:
    from specdraft.cli import main

    monkeypatch.chdir(cwd)
    return main(argv)


@pytest.mark.parametrize("where", ["a folder of the user's", "the working directory", "above it", "home"])
def test_export_overwrite_never_deletes_a_folder_it_did_not_write(built, tmp_path, monkeypatch, capsys, where):
    root, _ = built
    user = tmp_path / "proj"
    (user / "src").mkdir(parents=True)
    (user / "keep.txt").write_text("the user's")
    (user / "src" / "main.py").write_text("print('hi')\n")
    if where == "home":
        monkeypatch.setenv("HOME", str(user))
    cwd = {"a folder of the user's": tmp_path, "above it": user / "src"}.get(where, user)
    out = {"a folder of the user's": user, "the working directory": Path("."), "above it": Path(".."),
           "home": Path("~")}[where]
    before = snapshot(user)
    assert run_main(["export", str(root / "run"), "--format", "hf", "--out", str(out), "--overwrite"], cwd,
                    monkeypatch) == 2
    assert snapshot(user) == before
    err = capsys.readouterr().err
    assert ("did not write" in err) if where == "a folder of the user's" else ("will not write over it" in err)


def test_export_overwrite_replaces_its_own_export_and_refuses_one_the_user_added_to(built, tmp_path, monkeypatch,
                                                                                   capsys):
    root, _ = built
    args = ["export", str(root / "run"), "--format", "hf", "--out", "exp", "--overwrite"]
    assert run_main(args, tmp_path, monkeypatch) == 0
    assert run_main(args, tmp_path, monkeypatch) == 0  # its own export: replaced
    (tmp_path / "exp" / "notes.md").write_text("the user's notes")
    (tmp_path / "exp" / ".hidden").write_text("the user's too")
    before = snapshot(tmp_path / "exp")
    assert run_main(args, tmp_path, monkeypatch) == 2
    assert snapshot(tmp_path / "exp") == before
    assert "holds files that specdraft export did not write (.hidden, notes.md)" in capsys.readouterr().err


def eval_args(root: Path, out: str, *flags: str) -> list[str]:
    suite = root / "questions.jsonl"
    suite.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Hi there"]}) + "\n")
    return ["eval", "--target", str(root / "target"), "--prompts", str(suite), "--prompt-lookup",
            "--max-new-tokens", "3", "-k", "2", "--dtype", "float32", "--no-progress", "--out", out, *flags]


def test_eval_out_never_writes_over_the_users_files_and_replaces_its_own_only_when_asked(built, tmp_path,
                                                                                       monkeypatch, capsys):
    root, _ = built
    mine = tmp_path / "myreport"
    mine.mkdir()
    (mine / "report.md").write_text("the user's report")
    (mine / "result.json").write_text("{}")
    before = snapshot(mine)
    for flags in ((), ("--overwrite",)):
        assert run_main(eval_args(root, "myreport", *flags), tmp_path, monkeypatch) == 2
        assert snapshot(mine) == before
    assert "did not write" in capsys.readouterr().err
    assert run_main(eval_args(root, ".", "--overwrite"), tmp_path, monkeypatch) == 2  # the working directory
    assert snapshot(mine) == before

    assert run_main(eval_args(root, "rep"), tmp_path, monkeypatch) == 0
    first = snapshot(tmp_path / "rep")
    assert run_main(eval_args(root, "rep"), tmp_path, monkeypatch) == 2  # an earlier report: only with --overwrite
    assert snapshot(tmp_path / "rep") == first
    assert "pass --overwrite" in capsys.readouterr().err
    assert run_main(eval_args(root, "rep", "--overwrite"), tmp_path, monkeypatch) == 0
    assert (tmp_path / "rep" / "report.md").read_text() != ""


class Killed(BaseException):
    """A kill -9 at that instant: nothing after it runs (no except Exception, no cleanup of the step)."""


def test_a_kill_while_pruning_never_leaves_a_half_checkpoint_and_resume_works(built, tmp_path, monkeypatch):
    """keep_last prunes the oldest checkpoint; a kill halfway through its delete (trained.safetensors gone,
    trainer_state.json still there) must not leave a folder that checkpoint_dirs and --resume take for one."""
    root, raw = built
    raw = json.loads(json.dumps(raw))
    raw["checkpoint"].update(output_dir=str(tmp_path / "run"), keep_last=1)
    raw["training"]["max_steps"] = 6
    real = shutil.rmtree

    def killed_halfway(path, *args, **kwargs):
        path = Path(path)
        if (path / "trained.safetensors").is_file() and (path / "trainer_state.json").is_file():
            (path / "trained.safetensors").unlink()
            raise Killed
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.shutil, "rmtree", killed_halfway)
    with pytest.raises(Killed):
        train(parse_recipe(raw), show_progress=False)  # step 6's checkpoint is written, then step 3's is pruned
    monkeypatch.setattr(ckpt_module.shutil, "rmtree", real)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-0000006"]
    assert all((c / "trained.safetensors").is_file() for c in checkpoint_dirs(tmp_path / "run"))
    raw["training"]["max_steps"] = 9
    train(parse_recipe(raw), resume=True, show_progress=False)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-0000009"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".pruned-*"))  # the cut-short prune was finished


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_a_failure_at_each_step_of_the_swap_leaves_a_complete_folder(tmp_path, monkeypatch, failing):
    """atomic_folder's swap (rename the old folder aside, rename the new one in, delete the old): whichever of
    its filesystem steps fails, a complete folder is at the path (steps 1-2: the old one; 3: the new one)."""
    from specdraft import atomic

    path = tmp_path / "out"
    path.mkdir()
    (path / "a.txt").write_text("old a")
    (path / "b.txt").write_text("old b")
    steps = []
    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def step(real):
        def run(*args, **kwargs):
            steps.append(real.__name__)
            if len(steps) == failing:
                raise OSError(errno.EIO, "injected")
            return real(*args, **kwargs)
        return run

    with pytest.raises(OSError, match="injected"):
        with atomic.atomic_folder(path) as tmp:
            (tmp / "a.txt").write_text("new a")
            (tmp / "b.txt").write_text("new b")
            monkeypatch.setattr(Path, "rename", step(real_rename))
            monkeypatch.setattr(atomic.shutil, "rmtree", step(real_rmtree))
    monkeypatch.undo()
    assert steps[:failing] == ["rename", "rename", "rmtree"][:failing]  # the step that failed is the one named
    expected = "new" if failing == 3 else "old"
    assert {p.name: p.read_text() for p in path.iterdir()} == {"a.txt": f"{expected} a", "b.txt": f"{expected} b"}


def test_a_file_size_limit_during_a_checkpoint_is_reported_as_such_with_the_bytes_needed(built, tmp_path):
    """`ulimit -f` (EFBIG, which torch.save and safetensors report in words of their own): the user is told the
    limit was reached and how much a checkpoint needs, and the earlier checkpoint stays whole."""
    import resource
    import subprocess
    import sys

    root, raw = built
    biggest = max(f.stat().st_size for f in (root / "run" / "checkpoints").rglob("*") if f.is_file())
    raw = make_recipe(tmp_path, raw["target"]["path"], raw["data"]["path"], training={"max_steps": 6})
    recipe = write_recipe(tmp_path / "recipe.yaml", raw)
    limit = biggest // 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    tests = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, str(tests / "run_probe_train.py"), "train", str(recipe), "--no-progress"],
                         env={**os.environ, "PYTHONPATH": str(tests), "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "a file size limit was reached (EFBIG" in out.stderr and "A checkpoint needs about" in out.stderr
    assert "ulimit -f" in out.stderr and "Traceback" not in out.stderr
    assert not checkpoint_dirs(tmp_path / "run") and not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("flags", [(), ("--overwrite",)])
def test_a_recipe_inside_the_run_folder_it_names_is_never_written_over(built, tmp_path, flags):
    """`recipes copy toy_eagle3 exp1/recipe.yaml`, an edit, then `train exp1/recipe.yaml checkpoint.output_dir=exp1`:
    the user's recipe is an input, refused as a run folder's place (with or without --overwrite), and kept."""
    root, raw = built
    raw = json.loads(json.dumps(raw))
    raw["checkpoint"]["output_dir"] = str(tmp_path / "exp1")
    (tmp_path / "exp1").mkdir()
    recipe = write_recipe(tmp_path / "exp1" / "recipe.yaml", raw)
    before = snapshot(tmp_path / "exp1")
    out = run_cli(["train", str(recipe), "--no-progress", *flags], cwd=tmp_path)
    assert_refused(out, "is inside checkpoint.output_dir")
    assert "keep your recipe outside the run folder" in out.stderr
    assert snapshot(tmp_path / "exp1") == before


def test_a_refused_run_creates_nothing(tmp_path):
    """`specdraft train toy_eagle3` before any data exists: refused, and no empty runs/ folder left behind."""
    out = run_cli(["train", "toy_eagle3", "--no-progress"], cwd=tmp_path)
    assert_refused(out, "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_prompts_a_command_writes_for_regenerate_never_replace_a_file_of_the_users(tmp_path):
    """quickstart and `data sample` write the prompts they then answer: over nothing, the same prompts, or the
    file their own earlier regenerate read (its sidecar names it); never over a file of the user's."""
    from specdraft.data.regenerate import sidecar_of, write_prompts

    prompts, out = tmp_path / "answers.prompts.jsonl", tmp_path / "answers.jsonl"
    write_prompts(prompts, [{"turns": ["a"]}], out)
    write_prompts(prompts, [{"turns": ["a"]}], out)  # a rerun with the same prompts
    prompts.write_text("my own prompts\n")
    with pytest.raises(SpecdraftError, match="holds other prompts"):
        write_prompts(prompts, [{"turns": ["a"]}], out)
    assert prompts.read_text() == "my own prompts\n"
    sidecar_of(out).write_text(json.dumps({"written_by": "specdraft regenerate", "data": str(prompts)}))
    write_prompts(prompts, [{"turns": ["b"]}], out)  # regenerate read it: the command's own, from a rerun
    assert json.loads(prompts.read_text()) == {"turns": ["b"]} and list(tmp_path.glob(".*.tmp")) == []


def test_recipes_copy_overwrite_replaces_only_an_unedited_copy(tmp_path):
    from specdraft.recipe_files import copy_recipe, shipped_recipes

    dest = copy_recipe("toy_eagle3", tmp_path / "exp1.yaml")
    copy_recipe("toy_medusa1", dest, overwrite=True)  # an unedited copy: replaced
    assert dest.read_bytes() == shipped_recipes()["toy_medusa1"].read_bytes()
    edited = dest.read_text() + "# my note\n"
    dest.write_text(edited)
    with pytest.raises(SpecdraftError, match="holds edits"):
        copy_recipe("toy_eagle3", dest, overwrite=True)
    assert dest.read_text() == edited
