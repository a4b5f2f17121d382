"""`specdraft selftest`: the --quick run CI affords, its exit status, and the bad input it refuses.

Cost in CI: one `--quick` run on the CPU in a fresh process (86 to 151 s measured on these 2 shared cores,
as busy as other jobs made them: the interpreted kernels, 6 families trained 8 steps each with a resume and
their exports, every family's decodes compared with generate(), the verify-cost curve), and seconds for the rest.
"""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from specdraft import selftest as selftest_module
from specdraft.cli import main
from specdraft.config import parse_recipe
from specdraft.drafters import FAMILIES as REGISTERED

# Every family the package registers, DFlash among them, with no selftest edit; not the suite's own (the
# training tests register tests/probe_family.py's "probe" in this process, and the CLI's selftest never sees it).
FAMILIES = tuple(name for name, family in REGISTERED.items() if family.build.__module__.startswith("specdraft."))


def without_root_permission_override():
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so that
    root (CI runs as root) obeys permission bits as every other user does. A no-op for other users."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def cli(args, cwd=None, obey_permissions=False, timeout=900):
    """`python -m specdraft ARGS` in a fresh process, one torch thread; ``obey_permissions``: without root's
    override of permission bits (root writes into read-only folders)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the selftest sets it itself on a CPU
    return subprocess.run([sys.executable, "-m", "specdraft", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout,
                          preexec_fn=without_root_permission_override if obey_permissions else None)


def test_quick_selftest_passes_every_check_on_this_cpu_and_writes_its_report(tmp_path):
    done = cli(["selftest", "--quick", "--device", "cpu", "--out", str(tmp_path / "st")])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((tmp_path / "st" / "selftest.json").read_text())
    names = [c["name"] for c in record["checks"]]
    assert names == (["verify: chains", "verify: trees", "verify: exactness"] + [f"train: {f}" for f in FAMILIES]
                     + [f"decode: {f}" for f in FAMILIES] + ["verify cost"])
    assert all(c["ok"] for c in record["checks"]), [c for c in record["checks"] if not c["ok"]]
    assert record["environment"]["device"] == "cpu" and record["environment"]["torch"] == torch.__version__
    assert "in Triton's interpreter" in record["checks"][0]["detail"]  # the kernels, not the reference twice
    for check in record["checks"][3 : 3 + len(FAMILIES)]:
        assert "resume from step 4 identical" in check["detail"] and "DIFFERENT" not in check["detail"]
    assert "| chain | 4 |" in record["verify_cost"]
    markdown = (tmp_path / "st" / "selftest.md").read_text()
    assert "| train: medusa2 | ok |" in markdown and "| verify backend | reference (pure torch)" in markdown
    assert f"all {4 + 2 * len(FAMILIES)} checks passed" in done.stdout
    assert not [p for p in (tmp_path / "st").iterdir() if p.name.startswith("work-")]  # scratch removed


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_owns_the_settings_selftest_trains_it_with(family, tmp_path):
    """The family's registration gives its selftest run's drafter section, and it parses: its settings are the
    family's own fields, with valid values."""
    setup = selftest_module.Setup(torch.device("cpu"), True, tmp_path)
    raw = selftest_module.family_recipe(setup, family, tmp_path / "chat.jsonl", tmp_path / "run", 8)
    assert raw["drafter"] == {"family": family, **REGISTERED[family].selftest_settings}
    parse_recipe(raw)


def test_a_failing_check_fails_the_command_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(setup):
        raise RuntimeError("the kernel hung")

    monkeypatch.setattr(selftest_module, "check_verify_agreement", lambda setup, tree: (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_exactness", broken)
    monkeypatch.setattr(selftest_module, "check_verify_cost", lambda setup: (True, "fine", ""))
    monkeypatch.setattr(selftest_module, "FAMILIES", {})
    assert main(["selftest", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 1
    record = json.loads((tmp_path / "selftest.json").read_text())
    assert [(c["name"], c["ok"]) for c in record["checks"]] == [
        ("verify: chains", True), ("verify: trees", True), ("verify: exactness", False), ("verify cost", True)]
    assert "RuntimeError: the kernel hung" in record["checks"][2]["detail"]
    assert "the kernel hung" in (tmp_path / "selftest-errors.log").read_text()
    assert [p for p in tmp_path.iterdir() if p.name.startswith("work-")]  # kept for a look after a failure


def test_device_cuda_without_cuda_names_the_fix_before_writing_anything(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["selftest", "--device", "cuda", "--out", str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: CUDA is not available" in err and "--device cpu" in err
    assert "Traceback" not in err
    assert not (tmp_path / "st").exists()


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    yield folder
    folder.chmod(0o755)


def test_an_unwritable_out_folder_names_the_fix(read_only_folder):
    done = cli(["selftest", "--quick", "--device", "cpu", "--out", str(read_only_folder / "st")], obey_permissions=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{read_only_folder / 'st'}, which cannot be written (Permission denied)" in done.stderr
    assert "pass --out DIR in a folder you can write to" in done.stderr and "Traceback" not in done.stderr


def test_running_in_an_unwritable_working_folder_names_the_fix(read_only_folder):
    done = cli(["selftest", "--quick", "--device", "cpu"], cwd=read_only_folder, obey_permissions=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{read_only_folder / 'selftest'}, which cannot be written" in done.stderr
    assert "--out DIR" in done.stderr and "Traceback" not in done.stderr


def test_an_out_path_through_a_file_names_the_fix(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(selftest_module.SpecdraftError, match="a-file/st, which cannot be written"):
        selftest_module.writable_folder(tmp_path / "a-file" / "st")


def test_compiled_decoding_on_a_transformers_without_static_cache_rollback_is_reported_not_run(tmp_path,
                                                                                              monkeypatch):
    """The first GPU check (an H200 with transformers 5.17) failed every decode check: compile_target refuses a
    StaticCache that cannot roll back. The eager decodes still run; compiled decoding is named as not run, with
    the version, and the environment table names the fix."""
    cuda = selftest_module.Setup(torch.device("cuda"), False, tmp_path)
    assert selftest_module.decoding_compile_modes(cuda, False) == ([False, "reduce-overhead"], [])
    monkeypatch.setattr(selftest_module, "static_cache_rolls_back", lambda: False)
    modes, skipped = selftest_module.decoding_compile_modes(cuda, False)
    assert modes == [False] and skipped == [f"compile_target (needs transformers >= 5.23, this is "
                                            f"{selftest_module._version('transformers')})"]
    env = selftest_module.environment(torch.device("cpu"))
    assert env["compiled decoding"].startswith("NOT available") and "pip install -U 'transformers>=5.23'" in env[
        "compiled decoding"]


def test_families_limits_training_and_decoding_to_those_named(tmp_path, monkeypatch):
    trained, decoded = [], []
    monkeypatch.setattr(selftest_module, "check_verify_agreement", lambda setup, tree: (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_exactness", lambda setup: (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_verify_cost", lambda setup: (True, "fine", ""))
    monkeypatch.setattr(selftest_module, "check_training", lambda setup, family, data: trained.append(family) or
                        (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_decoding", lambda setup, family, tokens: decoded.append(family) or
                        (True, "fine"))
    assert main(["selftest", "--quick", "--device", "cpu", "--families", "medusa1", "dflash",
                 "--out", str(tmp_path)]) == 0
    assert trained == decoded == ["medusa1", "dflash"]
    with pytest.raises(SystemExit):
        main(["selftest", "--families", "eagle4", "--out", str(tmp_path)])


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_the_environment_says_whether_this_cpu_has_hardware_for_bf16(monkeypatch, native):
    monkeypatch.setattr(selftest_module, "cpu_computes_natively", lambda name: native)
    bf16 = selftest_module.environment(torch.device("cpu"))["bf16"]
    if native:
        assert bf16.startswith("native on this CPU")
    else:
        assert bf16.startswith("emulated on this CPU") and "target.dtype=float32 training.mixed_precision='no'" in bf16


def test_the_resume_checks_training_on_cuda_runs_deterministic_math_attention():
    """On CUDA the training checks compare a resumed run with a straight one bit for bit: flash and memory-efficient
    attention's backward add across split keys in any order unless deterministic mode is strict, so their SDPA is
    math alone; the caller's flags come back after. On a CPU nothing changes."""
    backends = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
                torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = ([read() for read in backends], torch.are_deterministic_algorithms_enabled())
    with selftest_module._deterministic(torch.device("cuda")):
        assert [read() for read in backends] == [False, False, False, True]
        assert torch.are_deterministic_algorithms_enabled()
    assert ([read() for read in backends], torch.are_deterministic_algorithms_enabled()) == before
    with selftest_module._deterministic(torch.device("cpu")):
        assert ([read() for read in backends], torch.are_deterministic_algorithms_enabled()) == before


def test_a_rerun_replaces_its_own_report_and_never_writes_into_a_folder_of_the_users(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(selftest_module, "check_verify_agreement", lambda setup, tree: (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_exactness", lambda setup: (True, "fine"))
    monkeypatch.setattr(selftest_module, "check_verify_cost", lambda setup: (True, "fine", ""))
    monkeypatch.setattr(selftest_module, "FAMILIES", {})
    for _ in range(2):  # the second run replaces the first one's report
        assert main(["selftest", "--quick", "--device", "cpu", "--out", str(tmp_path / "st")]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "selftest.md").write_text("my notes")
    assert main(["selftest", "--quick", "--device", "cpu", "--out", str(mine)]) == 2
    assert "did not write" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["selftest.md"] and (mine / "selftest.md").read_text() == "my notes"
