"""Task mixtures (mixture.py): several sources in one run, each drawn by its weight and scored by its own reward
functions; the reward matrix's NaN layout, the postprocess hook, per-task metrics and an exact resume, through the
real server and trainer."""
import collections
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from config import EMBEDDED_TASKS, UsageError, parse_config
from conftest import ROOT, run_train
from tests.helpers import near_target

GSM8K = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
RUN = ["--num_generations", "4", "--prompts_per_step", "4", "--max_completion_length", "8", "--bf16", "false",
       "--learning_rate", "1e-2", "--micro_batch_size", "8"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def two_sources(tmp_path, weights=(1, 3)) -> str:
    """A mixture file: `math` (GSM8K questions, scored by brevity and format) and `hello` (chat prompts with a
    target length only its rows have, scored by near_target), each with held-out rows."""
    gsm = [json.loads(line) for line in open(GSM8K)][:32]
    hello = [{"prompt": [{"role": "user", "content": f"Say hello in about {10 + 3 * i} characters."}],
              "target_len": 10 + 3 * i} for i in range(32)]
    files = {name: write_jsonl(tmp_path / f"{name}.jsonl", rows) for name, rows in
             (("math", gsm[:24]), ("math_eval", gsm[24:]), ("hello", hello[:24]), ("hello_eval", hello[24:]))}
    (tmp_path / "mixture.yaml").write_text(f"""tasks:
  - name: math
    dataset: {files['math']}
    weight: {weights[0]}
    reward_funcs: [tests.helpers:brevity, format]
    reward_weights: [1.0, 0.5]
    eval_dataset: {files['math_eval']}
  - name: hello
    dataset: {files['hello']}
    weight: {weights[1]}
    reward_funcs: tests.helpers:near_target
    system_prompt: You answer in as few words as you can.
    eval_dataset: {files['hello_eval']}
""")
    return str(tmp_path / "mixture.yaml")


def test_sources_on_the_command_line_get_names_weights_and_their_own_rewards():
    from mixture import parse_tasks
    tasks = parse_tasks(parse_config(["--dataset", "arithmetic:0.7,sums=./data/x.jsonl,parity:2"]))
    assert [(t.name, t.dataset, t.weight) for t in tasks] == [("arithmetic", "arithmetic", 0.7),
                                                              ("sums", "./data/x.jsonl", 1.0), ("parity", "parity", 2.0)]
    arithmetic = ("boxed_accuracy,format,accuracy", "1,0,1", EMBEDDED_TASKS["arithmetic"]["system_prompt"])
    assert [(t.reward_funcs, t.reward_weights, t.system_prompt) for t in tasks] == [
        arithmetic, ("accuracy,format", "", ""), ("choice", "", "")]  # an embedded task's own, a file: the flags'
    with pytest.raises(UsageError, match=r"--reward_funcs accuracy scores none of the tasks: each has its own "
                                         r"\(arithmetic: boxed_accuracy,format,accuracy, parity: choice\)"):
        parse_tasks(parse_config(["--dataset", "arithmetic,parity", "--reward_funcs", "accuracy"]))  # not silently
    for flags in (["--reward_funcs", "accuracy,format"], ["--reward_weights", "1,0"]):  # the default's value, given
        with pytest.raises(UsageError, match=f"{flags[0]} {flags[1]} scores none of the tasks"):
            parse_tasks(parse_config(["--dataset", "arithmetic,parity", *flags]))
    assert parse_config(["--reward_funcs", "accuracy,format"]).gives("reward_funcs")  # given, at the default's value
    assert not parse_config(["--dataset", "arithmetic"]).gives("reward_funcs")  # the task's own: not given
    file_too = parse_tasks(parse_config(["--dataset", "arithmetic,sums=./data/x.jsonl", "--reward_weights", "1,0"]))
    assert [t.reward_weights for t in file_too] == ["1,0,1", "1,0"]  # the file's task is scored by the flags
    mine = parse_tasks(parse_config(["--dataset", "arithmetic,parity", "--system_prompt", "Be brief."]))
    assert [t.system_prompt for t in mine] == ["Be brief.", "Be brief."]  # a system prompt given wins, as alone
    one, = parse_tasks(parse_config(["--dataset", "arithmetic"]))  # one dataset: a mixture of one, as before
    assert (one.name, one.weight, one.reward_funcs, one.reward_weights, one.system_prompt) == ("arithmetic", 1.0,
                                                                                               *arithmetic)
    trl = parse_tasks(parse_config(["--env", "calc=calculator,game=embedded:Guess", "--dataset", "x.jsonl"]))
    assert [(t.name, t.env, t.environment) for t in trl] == [("calc", "embedded:Calculator", "calc"),
                                                            ("game", "embedded:Guess", "game")]


@pytest.mark.parametrize("dataset, message", [
    ("arithmetic:0,parity", "task arithmetic: weight '0' must be a positive number"),
    ("arithmetic:-1,parity", "task arithmetic: weight '-1' must be a positive number"),
    ("arithmetic:inf,parity", "task arithmetic: weight 'inf' must be a positive number"),
    ("arithmetic,,parity", "an empty source between commas"),
    ("arithmetic,arithmetic:2", "two tasks are named 'arithmetic'"),
])
def test_weights_and_names_that_cannot_be_meant_are_refused(dataset, message):
    from mixture import parse_tasks
    with pytest.raises(UsageError, match=message):
        parse_tasks(parse_config(["--dataset", dataset]))


def test_a_mixture_file_says_which_key_it_does_not_know(tmp_path):
    from mixture import parse_tasks
    (tmp_path / "m.yaml").write_text("tasks:\n  - name: a\n    dataset: arithmetic\n    wieght: 2\n")
    with pytest.raises(UsageError, match="task a in .*m.yaml: unknown key 'wieght'"):
        parse_tasks(parse_config(["--dataset", str(tmp_path / "m.yaml")]))
    (tmp_path / "m.json").write_text(json.dumps({"tasks": [{"dataset": "arithmetic", "weight": 2},
                                                           {"name": "p", "dataset": "parity", "weight": "x"}]}))
    with pytest.raises(UsageError, match="task p: weight 'x' is not a number"):
        parse_tasks(parse_config(["--dataset", str(tmp_path / "m.json")]))


def test_a_source_that_cannot_load_or_score_or_fill_a_step_is_named(tmp_path, tokenizer):
    from mixture import load_mixture
    few = write_jsonl(tmp_path / "few.jsonl", [{"prompt": "hi", "answer": "1"}] * 3)
    cases = [(["--dataset", f"arithmetic,{tmp_path}/nope.jsonl"], "task nope: --dataset .*nope.jsonl: no such file"),
             (["--dataset", f"arithmetic,few={few}", "--prompts_per_step", "4"],
              "task few: 3 rows, fewer than one step takes"),
             (["--dataset", f"few={few},parity", "--prompts_per_step", "2", "--reward_funcs", "accuracy,nosuch"],
              "task few: unknown reward function 'nosuch'"),  # (the embedded tasks have their own)
             (["--dataset", f"arithmetic,few={few}", "--prompts_per_step", "2", "--reward_funcs",
               "tests.helpers:near_target"], "task few: .*near_target.* cannot be called")]
    for flags, message in cases:
        with pytest.raises(UsageError, match=message):
            load_mixture(parse_config(flags), tokenizer)


def test_each_step_draws_tasks_by_their_weights_and_a_resumed_run_draws_the_same(tokenizer):
    from mixture import load_mixture
    cfg = parse_config(["--dataset", "arithmetic:1,parity:3", "--num_arithmetic_problems", "50"])
    mixture = load_mixture(cfg, tokenizer)
    assert [row["task"] for row in mixture.rows] == ["arithmetic"] * 50 + ["parity"] * 50
    steps = [mixture.step_rows(step, 6, cfg.seed) for step in range(400)]
    counts = collections.Counter(mixture.rows[i]["task"] for rows in steps for i in rows)
    share = counts["parity"] / (400 * 6)
    assert abs(share - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 2400), share  # 4 standard errors
    per_task = collections.defaultdict(list)  # each task's rows in the order drawn: its own epochs, each row once
    for rows in steps:
        for i in rows:
            per_task[mixture.rows[i]["task"]].append(i)
    for task, drawn in per_task.items():
        epochs = [sorted(drawn[k:k + 50]) for k in range(0, len(drawn) - 49, 50)]
        assert len(epochs) >= 5 and all(len(set(e)) == 50 for e in epochs), task
    fresh = load_mixture(cfg, tokenizer)  # a resumed run: steps 300 on, without having drawn the ones before
    assert [fresh.step_rows(step, 6, cfg.seed) for step in range(300, 400)] == steps[300:]
    assert [mixture.step_rows(step, 6, cfg.seed + 1) for step in range(3)] != steps[:3]  # the seed matters


def test_no_two_samples_of_a_mixtures_step_share_a_random_stream(tokenizer):
    """Two tasks in one call, the default rollout: before, each task's request had the call's seed, so the j-th samples
    of the two tasks' first prompts shared a stream (and within a task, the j-th samples of every prompt). Now each
    task has its seed, and each prompt its request and seed: every request's seed differs."""
    from mixture import load_mixture
    from rollout import RolloutContext
    mixture = load_mixture(parse_config(["--dataset", "arithmetic:1,parity:1", "--num_arithmetic_problems", "10"]),
                           tokenizer)
    seeds = []

    class Recording:  # a stand-in for the server's client: each request's seed
        def generate(self, prompts, n, seed=None, **sampling):
            seeds.extend([seed] * len(prompts))
            return [dict(token_ids=[5], logprobs=[-1.0], finish_reason="stop")] * (len(prompts) * n)
    rows = [mixture.rows[i] for i in (0, 1, 10, 11)]  # two of each task
    ctx = RolloutContext(Recording(), tokenizer, 2, dict(max_tokens=4, temperature=1.0), seed=7)
    assert len(mixture.rollout(rows, ctx)) == 8 and len(seeds) == 4 and len(set(seeds)) == 4, seeds


def test_a_rows_reward_comes_from_its_own_columns_whatever_the_others_hold():
    from rewards import weighted_rewards
    matrix = torch.tensor([[1.0, 0.5, 7.0], [math.nan, math.nan, 0.25], [math.nan, 1.0, math.nan]])
    own = torch.tensor([[True, True, False], [False, False, True], [True, True, False]])
    weights = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0]])
    # row 0's third column (another task's) holds 7 after a postprocess hook: it adds nothing
    assert torch.equal(weighted_rewards(matrix, weights, own), torch.tensor([2.0, 0.75, 2.0]))
    assert weighted_rewards(matrix[:2, :2].clone().fill_(math.nan), weights[:2, :2], own[:2, :2]).isnan().all()


@pytest.mark.slow
def test_two_tasks_train_each_scored_by_its_own_rewards_and_resume_exactly(server, tmp_path, tokenizer):
    """Two processes, 4 steps of a two-task mixture with a postprocess hook: the matrix holds each row's own
    columns and NaN in the others (as the hook sees it and as rollouts.jsonl keeps it), the hook's output is what
    the rewards and advantages are made of, the per-task metrics are the means over each task's rows, each step's
    prompts are the weighted draw's, the evaluation is per task; 2 steps then a resume give the same run."""
    from mixture import load_mixture
    mixture_file = two_sources(tmp_path)
    flags = [*RUN, "--dataset", mixture_file, "--reward_postprocess", "tests.helpers:stretch_near_target",
             "--eval_steps", "2", "--eval_num_prompts", "4", "--num_generations_eval", "2", "--eval_pass_k", "1,2"]
    hook_log = tmp_path / "hook.jsonl"
    proc, metrics = run_train(server, tmp_path / "a", *flags, "--max_steps", "4", "--save_steps", "2",
                              "--save_total_limit", "0", env={"NANOGRPO_TEST_HOOK_LOG": str(hook_log)})
    brevity, format_, near = "tests.helpers:brevity", "format", "tests.helpers:near_target"
    own = {"math": {brevity, format_}, "hello": {near}}
    # the hook saw the matrix with each row's own columns filled and the others NaN, and which task each row is
    calls = [json.loads(line) for line in open(hook_log)]
    assert calls and all(c["names"] == [brevity, format_, near] for c in calls)
    assert {t for c in calls for t in c["tasks"]} == {"math", "hello"}
    for c in calls:
        for task, nan in zip(c["tasks"], c["nan"]):
            assert [not v for v in nan] == [name in own[task] for name in c["names"]]
    records = [json.loads(line) for line in open(tmp_path / "a" / "rollouts.jsonl")]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 4 * 16
    for r in records:  # as kept: the other task's columns not scored (None); the reward of its own, after the hook
        task = r["columns"]["task"]
        assert {k for k, v in r["rewards"].items() if v is not None} == own[task]
        if task == "hello":
            stretched = 2 * near_target([r["completion"]], [r["columns"]["target_len"]])[0] - 1
            assert r["rewards"][near] == pytest.approx(stretched, abs=1e-6) and r["reward"] == pytest.approx(stretched)
        else:
            assert r["reward"] == pytest.approx(r["rewards"][brevity] + 0.5 * r["rewards"][format_], abs=1e-6)
    groups = collections.defaultdict(list)  # the advantages are the groups' normalized rewards (after the hook)
    for r in train:
        groups[(r["step"], r["rank"], r["prompt_index"])].append(r)
    assert len(groups) == 16 and all(len(g) == 4 for g in groups.values())
    for group in groups.values():
        rewards = torch.tensor([r["reward"] for r in group], dtype=torch.float64)
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        assert [r["advantage"] for r in group] == pytest.approx(expected.tolist(), abs=1e-4)
    # each step's prompts: the weighted draw (the same function, in a fresh process), and the per-task means
    cfg = parse_config(flags)
    mixture = load_mixture(cfg, tokenizer)
    for m in (m for m in metrics if "reward" in m):
        step_rows = [r for r in train if r["step"] == m["step"]]
        drawn = mixture.step_rows(m["step"] - 1, 4, cfg.seed)
        assert sorted(r["prompt_index"] for r in step_rows) == sorted(drawn * 4)
        for name in ("math", "hello"):
            mine = [r for r in step_rows if r["columns"]["task"] == name]
            assert m[f"task/{name}/prompts"] == len(mine) / 4
            if mine:
                assert m[f"task/{name}/reward"] == pytest.approx(sum(r["reward"] for r in mine) / len(mine), abs=1e-5)
                for fn in own[name]:
                    assert m[f"task/{name}/rewards/{fn}"] == pytest.approx(
                        sum(r["rewards"][fn] for r in mine) / len(mine), abs=1e-5)
        assert m[f"rewards/{near}_nan_frac"] == 0  # the other task's rows are not "not scored"
    assert sum(m["task/hello/prompts"] for m in metrics if "reward" in m) > 0
    assert sum(m["task/math/prompts"] for m in metrics if "reward" in m) > 0
    evals = [m for m in metrics if "eval/reward" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    for m in evals:
        for name in ("math", "hello"):
            assert m[f"eval/task/{name}/num_prompts"] == 4 and f"eval/task/{name}/pass@1" in m
        assert f"eval/task/hello/rewards/{near}" in m and f"eval/task/math/rewards/{near}" not in m
    assert proc.stdout.strip().splitlines()[-1].startswith("held-out math: ")  # the summary, per task, last
    assert "; hello: " in proc.stdout.strip().splitlines()[-1]
    assert " | math " in proc.stdout and " hello " in proc.stdout  # the console line's per-task rewards
    # 2 steps, then a new run resuming from checkpoint-2: the same prompts, completions and rewards
    run_train(server, tmp_path / "b", *flags, "--max_steps", "2", "--save_steps", "2",
              env={"NANOGRPO_TEST_HOOK_LOG": str(hook_log)})
    run_train(server, tmp_path / "b", *flags, "--max_steps", "4", "--resume_from_checkpoint", "latest",
              env={"NANOGRPO_TEST_HOOK_LOG": str(hook_log)})
    ledger = {run: [(r["split"], r["step"], r["rank"], r["prompt_index"], r["completion"], r["reward"])
                    for r in map(json.loads, open(tmp_path / run / "rollouts.jsonl"))] for run in ("a", "b")}
    assert ledger["b"] == ledger["a"]
    # a mixture file changed between the two runs: its weights decide the draw, so the resume is refused
    two_sources(tmp_path, weights=(1, 1))
    proc = run_train(server, tmp_path / "b", *flags, "--max_steps", "6", "--resume_from_checkpoint", "latest",
                     check=False, nproc=1)
    assert proc.returncode == 2 and "cannot resume from" in proc.stderr and "--tasks" in proc.stderr


@pytest.mark.slow
def test_trls_dict_of_environments_runs_each_row_in_the_environment_its_column_names(server, tmp_path):
    """--env name=factory,... with an `environment` column (TRL's form): each row is a task of its environment, its
    prompt shows that environment's tools only, and the environment's get_reward() scores that task's rows alone."""
    rows = [{"prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "environment": "calc"} for i in range(6)]
    rows += [{"prompt": "Let us play.", "environment": "game", "answer": None} for _ in range(6)]
    data = write_jsonl(tmp_path / "both.jsonl", rows)
    _, metrics = run_train(server, tmp_path / "out", *RUN, "--max_completion_length", "24", "--max_steps", "2",
                           "--prompts_per_step", "4", "--dataset", data, "--env", "calc=calculator,game=guess",
                           "--reward_funcs", "tests.helpers:brevity", "--no_save_model")
    records = [json.loads(line) for line in open(tmp_path / "out" / "rollouts.jsonl")]
    assert len(records) == 2 * 16 and {r["columns"]["task"] for r in records} == {"calc", "game"}
    for r in records:
        calc = r["columns"]["environment"] == "calc"
        assert r["columns"]["task"] == r["columns"]["environment"]
        assert ('"calculate"' in r["prompt"], '"guess"' in r["prompt"]) == (calc, not calc)  # its own tools only
        assert r["rewards"]["tests.helpers:brevity"] is not None and (r["rewards"]["Guess"] is None) == calc
    for m in metrics:
        assert m["task/calc/prompts"] + m["task/game/prompts"] == 4 and m["rewards/Guess_nan_frac"] == 0
        assert "task/calc/rewards/Guess" not in m


@pytest.mark.slow
def test_a_mixture_mistake_stops_train_py_in_one_line_naming_the_task(tiny_model, tmp_path):
    from tests.test_bad_input import offline_train_args, starts_fail
    sums = write_jsonl(tmp_path / "sums.jsonl", [{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(8)])
    lines = starts_fail([offline_train_args(tiny_model, tmp_path / "a", "--dataset", "arithmetic:2,parity:zero"),
                         offline_train_args(tiny_model, tmp_path / "b", "--dataset", f"sums={sums},parity",
                                            "--reward_funcs", "accuracy,nosuch")])
    assert lines[0] == ("error: task parity: weight 'zero' is not a number; give a positive number, e.g. "
                        "parity:0.5")
    assert lines[1] == ("error: task sums: unknown reward function 'nosuch' in --reward_funcs: use one of "
                        "['accuracy', 'boxed_accuracy', 'choice', 'format', 'overlong_penalty', 'tag_count'], "
                        "your own as "
                        "module:function, or a reward model folder as a path (./my_rm)")


def test_a_file_or_folder_whose_name_has_a_comma_colon_or_equals_is_one_dataset(tmp_path):
    from config import is_mixture_spec
    folder = tmp_path / "split=train"
    folder.mkdir()
    odd = write_jsonl(folder / "a,b:1.jsonl", [{"prompt": "hi"}])
    records = write_jsonl(tmp_path / "records.json", [{"prompt": "hi", "tasks": ["a"]}])  # JSON lines, a tasks column
    (tmp_path / "mix.json").write_text(json.dumps({"tasks": [{"dataset": "arithmetic"}]}))
    assert not is_mixture_spec(odd) and not is_mixture_spec(str(folder)) and not is_mixture_spec(records)
    assert is_mixture_spec(str(tmp_path / "mix.json")) and is_mixture_spec("a.jsonl:2") and is_mixture_spec("x=a.jsonl")


def test_a_mixture_file_keeps_what_it_says_and_leaves_out_what_it_leaves_empty(tmp_path):
    from mixture import parse_tasks
    (tmp_path / "m.yaml").write_text("tasks:\n  - dataset: parity\n    system_prompt:\n"
                                     "  - dataset: parity\n    name: p2\n    reward_funcs: [accuracy, format]\n"
                                     "  - name: game\n    env: guess\n"
                                     "  - dataset: arithmetic\n    reward_funcs: accuracy\n")
    first, second, game, sums = parse_tasks(parse_config(["--dataset", str(tmp_path / "m.yaml")]))
    assert (sums.reward_funcs, sums.reward_weights) == ("accuracy", "")  # a preset's weights go with its functions
    assert (first.name, first.reward_funcs, first.system_prompt) == ("parity", "choice", "")  # its own; no "None"
    assert second.reward_funcs == "accuracy,format"  # what the file says, though parity has its own
    assert (game.dataset, game.env, game.reward_funcs) == ("none", "embedded:Guess", "")  # guess: its reward only
    with pytest.raises(UsageError, match="task a: reward_funcs 'accuracy,accuracy' names a function twice"):
        from mixture import Task, _weights
        _weights(Task(name="a", dataset="arithmetic", reward_funcs="accuracy,accuracy"))


def fake_mixture():
    """Two tasks without loading anything: `a` scored by format then tag_count, `b` by accuracy then format."""
    from mixture import Mixture, Task
    a = Task(name="a", dataset="x", reward_funcs="format,tag_count", rows=[{"prompt": "p", "task": "a"}] * 3,
             eval_rows=[{"prompt": "p", "task": "a"}])
    b = Task(name="b", dataset="y", reward_funcs="accuracy,format", rows=[{"prompt": "q", "task": "b"}] * 3,
             eval_rows=[{"prompt": "q", "task": "b"}])
    return Mixture([a, b], mixed=True)


def test_per_task_metrics_and_pass_at_k_equal_a_loop_over_each_tasks_rows():
    from metrics import pass_at_k
    mixture = fake_mixture()
    assert mixture.names == ["format", "tag_count", "accuracy"] and mixture.first.tolist() == [0, 2]
    nan = math.nan
    rows = [{"task": "a"}, {"task": "b"}, {"task": "a"}]  # 3 prompts x n=2 completions
    matrix = torch.tensor([[1.0, 0.5, nan], [0.0, nan, nan], [1.0, nan, 0.0], [1.0, nan, 1.0],
                           [0.0, 0.25, nan], [1.0, 1.0, nan]])
    rewards = torch.tensor([1.5, 0.0, 1.0, 1.0, 0.25, 2.0])
    out = mixture.eval_metrics(rows, matrix, rewards, torch.tensor([3.0, 4, 5, 6, 7, 8]), 2, [1, 2])
    correct = {"a": [], "b": []}  # per prompt: completions whose task's first function gives >= 1
    for p, row in enumerate(rows):
        first = 0 if row["task"] == "a" else 2
        correct[row["task"]].append(sum(matrix[2 * p + i, first] >= 1 for i in range(2)))
    for task in ("a", "b"):
        for k in (1, 2):
            expected = sum(pass_at_k(2, int(c), k) for c in correct[task]) / len(correct[task])
            assert out[f"eval/task/{task}/pass@{k}"] == pytest.approx(expected)
    assert out["eval/task/b/pass@1"] == 0.5  # b is judged by accuracy (1 of 2), not by format (2 of 2)
    assert out["eval/task/a/pass@1"] == 0.5 and out["eval/task/a/rewards/tag_count"] == pytest.approx(1.75 / 4)
    assert "eval/task/a/rewards/accuracy" not in out and out["eval/rewards/accuracy"] == 0.5  # b's rows only
    assert out["eval/rewards/format"] == pytest.approx(4 / 6) and out["eval/completion_length"] == 5.5
    zero_std = torch.tensor([False, False, True, True, False, False])
    episodes = [SimpleNamespace(row=row) for row in rows[0:1] * 2 + rows[1:2] * 2 + rows[2:3] * 2]
    step = mixture.metrics(episodes, rewards, matrix, zero_std, G=2)
    assert step["task/a/prompts"] == 2 and step["task/b/prompts"] == 1
    assert step["task/a/reward"] == pytest.approx((1.5 + 0.0 + 0.25 + 2.0) / 4)
    assert step["task/b/rewards/accuracy"] == 0.5 and step["task/a/frac_zero_std_groups"] == 0
    assert step["task/b/frac_zero_std_groups"] == 1 and "task/a/rewards/accuracy" not in step


def test_the_postprocess_hook_is_checked_at_start_and_not_shown_an_empty_batch():
    from rewards import load_postprocess, postprocess_rewards, postprocessed
    assert load_postprocess("") is postprocess_rewards
    assert load_postprocess("tests.helpers:stretch_near_target").__name__ == "stretch_near_target"
    with pytest.raises(UsageError, match="cannot be called as f\\(matrix, names, tasks\\)"):
        load_postprocess("tests.helpers:brevity")  # (completions, **kwargs): no
    with pytest.raises(UsageError, match="could not load it"):
        load_postprocess("tests.helpers:nothing_here")
    empty = torch.zeros(0, 2)
    assert postprocessed(lambda m, n, t: 1 / 0, empty, ["a", "b"], []) is empty
    from config import RunStopped
    with pytest.raises(RunStopped, match="returned Tensor \\(1,\\) for a float matrix of shape \\(2, 2\\)"):
        postprocessed(lambda m, n, t: m[0, :1], torch.zeros(2, 2), ["a", "b"], ["x", "y"])
