"""eval/bench_families.py's per-family overrides and bench_medusa2_drift.py's variants (the logic, not the figures)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from bench_families import overrides_for


def test_a_family_prefixed_override_reaches_that_family_alone():
    given = ["training.max_steps=250", "medusa2:drafter.joint_from_step=75",
             "mlp_speculator:drafter.stage2_start_step=175", "data.path=/a:b/answers.jsonl"]
    assert overrides_for("medusa2", given) == ["training.max_steps=250", "drafter.joint_from_step=75",
                                               "data.path=/a:b/answers.jsonl"]
    assert overrides_for("mlp_speculator", given) == ["training.max_steps=250", "drafter.stage2_start_step=175",
                                                      "data.path=/a:b/answers.jsonl"]
    assert overrides_for("eagle3", given) == ["training.max_steps=250", "data.path=/a:b/answers.jsonl"]


def test_an_unknown_family_prefix_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="'medusa3' is not a family; known: .*medusa2"):
        overrides_for("eagle3", ["medusa3:drafter.joint_from_step=75"])


def test_a_medusa2_drift_variant_is_a_name_and_its_overrides():
    from bench_medusa2_drift import parse_variant

    assert parse_variant("low lr:optimizer.lr=5e-5,drafter.head_lr_multiplier=20") == (
        "low lr", ["optimizer.lr=5e-5", "drafter.head_lr_multiplier=20"])
    assert parse_variant("the recipe:") == ("the recipe", [])
    with pytest.raises(SystemExit, match="NAME:KEY=VALUE"):
        parse_variant("optimizer.lr=5e-5")


def test_the_temperatures_side_by_side_measure_what_one_after_the_other_does(tmp_path):
    """Two spawned processes, the models read from their folders: the same acceptance, position by position,
    as the in-process evaluation (timings aside)."""
    from bench_eagle import evaluate_at_temperatures, evaluate_temperatures_side_by_side
    from tiny import save_tiny_target

    from specdraft.drafters import load_drafter
    from specdraft.drafters.distillspec import DISTILLSPEC, DistillSpecConfig
    from specdraft.evaluation.suites import Prompt
    from specdraft.target import FrozenTarget

    target_dir = save_tiny_target(tmp_path / "target")
    target = FrozenTarget.from_pretrained(target_dir, dtype="float32")
    DISTILLSPEC.build(target, DistillSpecConfig(num_layers=1)).save_pretrained(tmp_path / "student")
    prompts = [Prompt("1", "s", "writing", "question", ["Write a poem.", "Shorter."]),
               Prompt("2", "s", "qa", "question", ["How many legs does a spider have?"])]
    folders = {"student": tmp_path / "student"}
    apart = evaluate_temperatures_side_by_side(target_dir, folders, prompts, 12, tmp_path / "apart")
    together = evaluate_at_temperatures(target, {"student": load_drafter(folders["student"], target).eval()},
                                        prompts, 12, tmp_path / "together")
    assert set(apart) == set(together) == {0.0, 1.0}
    for temperature, result in together.items():
        for method in ("student", "prompt-lookup"):
            ours, theirs = apart[temperature]["methods"][method]["overall"], result["methods"][method]["overall"]
            keys = ("num_tokens", "acceptance_length", "position_acceptance", "alpha_measured")
            assert json.dumps([ours[k] for k in keys]) == json.dumps([theirs[k] for k in keys]), (temperature, method)
    assert together[0.0]["methods"]["student"]["overall"]["num_tokens"] > 0


def test_the_distillspec_grid_puts_each_cell_under_its_divergence_and_data():
    from bench_distillspec import cells, grid_table

    def overall(tau, alpha):
        return {"overall": {"acceptance_length": tau, "alpha_measured": alpha}}

    names = [*cells(), "init-only", "prompt-lookup"]
    results = {t: {"methods": {name: overall(1 + i / 100 + t, i / 100) for i, name in enumerate(names)}}
               for t in (0.0, 1.0)}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in grid_table(results).splitlines()[2:]}
    assert list(rows) == ["FKL", "RKL", "JSD(0.5)", "TVD", "CE (next token)", "untrained (init only)"]
    assert rows["RKL"][1] == "1.04 (0.04)"  # rkl-onpolicy0.5, T=0: the 5th cell
    assert rows["TVD"][5].rstrip(" |") == "2.11 (0.11)"  # tvd-onpolicy1, T=1
    assert rows["CE (next token)"] == ["1.12 (0.12)", "-", "-", "2.12 (0.12)", "-", "- |"]
    assert rows["untrained (init only)"][3] == "2.13 (0.13)"


def test_time_in_forwards_counts_the_first_modules_calls_and_only_inside_its_context():
    import torch

    from bench_distillspec import time_in_forwards

    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    x = torch.ones(1, 4)
    with time_in_forwards([body, head]) as spent:
        head(body(x))
        head(body(x))
        head(x.new_ones(1, 4))
    assert spent["calls"] == 2  # the body's calls (the target's forwards), not the head's
    assert spent["seconds"] > 0
    seconds = spent["seconds"]
    body(x), head(x)  # outside the context: the hooks are gone
    assert spent == {"seconds": seconds, "calls": 2}


def test_a_sigterm_to_the_bench_ends_its_spawned_workers_too(tmp_path):
    """`pkill -f bench_...` signals the main process alone: its pool's workers must not go on unseen."""
    import signal
    import subprocess

    script = tmp_path / "bench.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'eval')!r})\n"
        "from bench_eagle import spawned_workers\n"
        "if __name__ == '__main__':\n"
        "    with spawned_workers(2) as pool:\n"
        "        futures = [pool.submit(time.sleep, 300) for _ in range(2)]\n"
        "        print(*[p.pid for p in multiprocessing.active_children()], flush=True)\n"
        "        futures[0].result()\n"
    )
    bench = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in bench.stdout.readline().split()]
    assert len(workers) == 2
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


def test_dflash_drafts_its_whole_block_beside_the_others_at_k_and_the_table_says_which_k(tmp_path):
    """Issue 34: DFlash at chain K = block_size - 1 in an evaluate of its own, merged beside the K=5 methods;
    the table's K column and position columns follow each method's K."""
    from bench_eagle import K, markdown_table
    from bench_families import evaluate_at_chain_ks
    from tiny import save_tiny_target

    from specdraft.drafters.dflash import DFLASH, DFlashConfig
    from specdraft.drafters.distillspec import DISTILLSPEC, DistillSpecConfig
    from specdraft.evaluation.suites import Prompt
    from specdraft.target import FrozenTarget

    target = FrozenTarget.from_pretrained(save_tiny_target(tmp_path / "target", num_hidden_layers=4),
                                          dtype="float32")
    drafters = {"student": DISTILLSPEC.build(target, DistillSpecConfig(num_layers=1)).eval(),
                "dflash": DFLASH.build(target, DFlashConfig(block_size=4, num_layers=1, mask_token_id=1)).eval()}
    prompts = [Prompt("1", "s", "writing", "question", ["Write a poem."])]
    results = evaluate_at_chain_ks(target, drafters, prompts, 12, tmp_path / "eval")
    for result in results.values():
        assert result["chain_k"] == {"plain": None, "student": K, "prompt-lookup": K, "dflash": 3}
        assert list(result["methods"]) == ["plain", "student", "prompt-lookup", "dflash"]
        assert len(result["methods"]["dflash"]["overall"]["position_acceptance"]) == 3
        assert len(result["methods"]["student"]["overall"]["position_acceptance"]) == K
        assert set(result["plain_of_other_k"]) == {3}
        table = markdown_table(result).splitlines()
        assert table[0].startswith("| method | K | tau | pos 1 |") and f"pos {K} |" in table[0]
        assert table[2].startswith("| plain | - |") and table[5].startswith("| dflash | 3 |")
    assert "dflash" in results[0.0]["greedy_identical"]
    assert (tmp_path / "eval" / "k-3" / "temperature-0").is_dir()


def test_chain_k_evaluates_a_family_at_the_k_asked_for():
    """--chain-k dflash=1: the K the verify-cost model recommends (issue 34), not the block's."""
    from types import SimpleNamespace

    from bench_eagle import K
    from bench_families import chain_k, parse_chain_ks

    dflash = SimpleNamespace(family="dflash", config=SimpleNamespace(block_size=8))
    eagle3 = SimpleNamespace(family="eagle3", config=SimpleNamespace())
    chosen = parse_chain_ks(["dflash=1"])
    assert (chain_k(dflash), chain_k(dflash, chosen), chain_k(eagle3, chosen)) == (7, 1, K)
    for bad in ("dflash", "dflash=0", "=2", "dflash=x"):
        with pytest.raises(SystemExit, match="expected FAMILY=K"):
            parse_chain_ks([bad])


def test_a_run_trained_again_after_its_overrides_changed_replaces_its_stale_record(tmp_path):
    # The bench keeps bench_record.json in each run folder. When the stamp no longer matched, it retrained with
    # --overwrite, which refuses a folder holding a file specdraft did not write: every rerun with another budget
    # stopped there.
    from bench_families import recipe_for, train_family

    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                     {"role": "assistant", "content": f"{i} {i} {i}, said."}]}) + "\n"
                            for i in range(6)))
    run = tmp_path / "runs" / "eagle3"
    overrides = [f"data.path={data}", f"checkpoint.output_dir={run}", "data.eval_fraction=0", "data.max_length=64",
                 "training.micro_batch_size=2", "training.eval_every=0", "eval.enabled=false",
                 "drafter.draft_vocab_size=null", "training.max_steps=1"]
    first = train_family("eagle3", recipe_for("toy", "eagle3"), overrides, run, "data")
    again = train_family("eagle3", recipe_for("toy", "eagle3"), overrides, run, "data")
    longer = train_family("eagle3", recipe_for("toy", "eagle3"), overrides + ["training.max_steps=2"], run, "data")
    assert first["steps"] == 1 and again["reused"]
    assert longer["steps"] == 2 and "reused" not in longer
    assert json.loads((run / "bench_record.json").read_text())["steps"] == 2


def test_the_learning_curves_plot_each_runs_held_out_evals_by_step(tmp_path, monkeypatch):
    """Training rows and the final eval's repeat of the last step are not points of the curve."""
    from bench_eagle import eval_rows, plot_learning_curves

    runs = {}
    for name, accs in (("eagle3", (0.1, 0.2, 0.3)), ("medusa1", (0.05, 0.1, 0.15))):
        run_dir = tmp_path / name
        run_dir.mkdir()
        rows = [{"step": 10, "train/acc_0": 0.9, "train/loss": 5.0}]
        rows += [{"step": 10 * (i + 1), "eval/acc_0": acc, "eval/sim_accept_len": 2 * acc}
                 for i, acc in enumerate(accs)]
        rows.append({"step": 30, "eval/acc_0": accs[-1], "eval/sim_accept_len": 2 * accs[-1]})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs[name] = run_dir
    assert {step: row["eval/acc_0"] for step, row in eval_rows(runs["eagle3"]).items()} == {10: 0.1, 20: 0.2, 30: 0.3}
    plotted = []
    monkeypatch.setattr("matplotlib.axes.Axes.plot", lambda self, *xy, **kw: plotted.append((kw["label"], *xy)))
    plot_learning_curves(runs, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # acc_0 then sim_accept_len, against the optimizer step: these runs logged no tokens seen
    assert plotted[0] == ("eagle3", (10, 20, 30), (0.1, 0.2, 0.3))
    assert plotted[2][:2] == ("eagle3", (10, 20, 30)) and len(plotted) == 4

    for name, run_dir in runs.items():  # with train/tokens_seen at every eval step: against thousands of tokens
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.writelines(json.dumps({"step": 10 * (i + 1), "train/tokens_seen": 1500.0 * (i + 1)}) + "\n"
                         for i in range(3))
    plotted.clear()
    plot_learning_curves(runs, tmp_path / "curves.png")
    assert plotted[0] == ("eagle3", (1.5, 3.0, 4.5), (0.1, 0.2, 0.3))


def test_the_loss_grid_gives_each_family_its_own_overrides_and_each_run_its_loss():
    from bench_losses import grid_runs

    runs = grid_runs({"eagle3": Path("e3.yaml"), "medusa1": Path("m1.yaml")}, ["ce", "tvd"],
                     ["training.max_steps=30", "eagle3:optimizer.warmup_steps=3", "medusa1:drafter.warmup_ratio=0.2"])
    assert sorted(runs) == ["eagle3-ce", "eagle3-tvd", "medusa1-ce", "medusa1-tvd"]
    assert runs["eagle3-tvd"] == ("eagle3", Path("e3.yaml"),
                                  ["training.max_steps=30", "optimizer.warmup_steps=3", "drafter.loss=tvd"])
    assert runs["medusa1-ce"] == ("medusa1", Path("m1.yaml"), ["training.max_steps=30", "drafter.warmup_ratio=0.2",
                                                                "drafter.distill=true", "drafter.loss=ce"])


@pytest.mark.parametrize("dtype, warned", [("bfloat16", True), ("float32", False)])
def test_answers_in_a_half_precision_this_cpu_emulates_warn_with_the_flag_to_change(tmp_path, monkeypatch, capsys,
                                                                                     dtype, warned):
    from bench_families import target_answers
    from tiny import save_tiny_target

    from specdraft import dtypes

    monkeypatch.setattr(dtypes, "cpu_computes_natively", lambda name: name in ("float32", torch.float32))
    target = save_tiny_target(tmp_path / "target")
    answers, _ = target_answers(target, tmp_path / "work", "answers", [{"id": "a", "turns": ["Hi"]}], 2, dtype)
    assert len(answers.read_text().splitlines()) == 1
    out = capsys.readouterr().out
    assert ("warning: --answer-dtype bfloat16: this CPU has no hardware" in out) == warned
    assert ("Use float32 here: --answer-dtype float32" in out) == warned


def test_answers_from_another_run_are_read_there_only_if_this_target_wrote_them(tmp_path, monkeypatch):
    """--answers-from (e.g. a GPU run's data folder): the asked-for prompts' answers, in their order, without
    generating; refused when another target, other settings, or missing prompts would be trained on."""
    from bench_families import target_answers
    from tiny import save_tiny_target

    from specdraft.data import regenerate

    target = save_tiny_target(tmp_path / "target")
    prompts = [{"id": f"p{i}", "turns": [f"Question {i}?"]} for i in range(4)]
    made, _ = target_answers(target, tmp_path / "gpu", "answers", prompts, 3, "float32")
    made_by_id = {json.loads(line)["id"]: line for line in made.read_text().splitlines()}

    def no_generating(*args, **kwargs):
        raise AssertionError("--answers-from must not generate")

    monkeypatch.setattr(regenerate, "regenerate", no_generating)
    asked = [prompts[2], prompts[0]]  # a subset, in another order
    answers, record = target_answers(target, tmp_path / "here", "answers", asked, 3, "float32",
                                     answers_from=tmp_path / "gpu" / "data")
    assert answers == tmp_path / "here" / "data" / "answers.jsonl"
    assert answers.read_text().splitlines() == [made_by_id["p2"], made_by_id["p0"]]
    assert record["answers_from"] == str(tmp_path / "gpu" / "data") and record["prompts"] == 2

    def refused(target_dir, prompts, max_new_tokens=3, dtype="float32"):
        with pytest.raises(SystemExit) as stopped:
            target_answers(target_dir, tmp_path / "here", "answers", prompts, max_new_tokens, dtype,
                           answers_from=tmp_path / "gpu" / "data")
        return str(stopped.value)

    assert "max_new_tokens: 3 there, 5 here" in refused(target, asked, max_new_tokens=5)
    assert "target_weights" in refused(target, asked, dtype="bfloat16")  # the weights as loaded in that dtype
    other = save_tiny_target(tmp_path / "other", seed=1)
    assert "target_weights" in refused(other, asked)
    assert "1 of the 3 answers prompts are not answered there (first: p9)" in refused(
        target, asked + [{"id": "p9", "turns": ["Question 9?"]}])
    assert "to other questions" in refused(target, [{"id": "p1", "turns": ["Another question?"]}])
    with pytest.raises(SystemExit, match="no answers.all.jsonl with regenerate's record"):
        target_answers(target, tmp_path / "here", "answers", asked, 3, "float32", answers_from=tmp_path / "none")


def test_the_arguments_with_answers_from_dump_to_results_json():
    """The benches write vars(args) into results.json: every argument, --answers-from included, is plain JSON,
    in this bench's own parser and in the grids' (add_grid_arguments)."""
    import argparse

    from bench_families import add_grid_arguments, argument_parser

    grid = argparse.ArgumentParser()
    add_grid_arguments(grid, "work", 10)
    for parser in (grid, argument_parser()):
        args = parser.parse_args(["--answers-from", "GPU/data"])
        assert json.loads(json.dumps(vars(args)))["answers_from"] == "GPU/data"


def test_data_only_makes_the_answers_and_trains_nothing(tmp_path, monkeypatch, capsys):
    """--data-only: the training and held-out answers the grids read, from the prompt files given, then a stop."""
    import bench_families

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"Count to {i}."]}) + "\n" for i in range(5)))
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2 + 2?"]}) + "\n")
    work = tmp_path / "work"
    monkeypatch.setattr(sys, "argv", ["bench_families.py", "--target", "toy", "--train-prompts", str(train),
                                      "--eval-prompts", str(questions), "--num-train-prompts", "3",
                                      "--heldout-answers", "2", "--answer-tokens", "4", "--answer-dtype", "float32",
                                      "--work", str(work), "--data-only"])
    bench_families.main()
    answers = [json.loads(line) for line in (work / "data" / "answers.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (work / "data" / "heldout_answers.jsonl").read_text().splitlines()]
    assert len(answers) == 3 and len(heldout) == 2
    # the two slices are disjoint: the training slice from the shuffled file's start, the held-out from its end
    assert not {a["id"] for a in answers} & {h["id"] for h in heldout}
    assert all(record["messages"][-1]["role"] == "assistant" for record in answers + heldout)
    assert sorted(path.name for path in work.iterdir()) == ["data"]  # no runs, exports or reports
    assert "the target's answers:" in capsys.readouterr().out
