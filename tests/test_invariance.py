"""The gradient of one optimizer step does not depend on how the step is split: one process with 4
accumulation steps, two processes (torchrun, gloo) with 2 each, and one process with one big batch
give the same gradient in float64 (every loss type, the masks and the entropy bonus; bnpo is split-dependent by
definition), under
DDP and under FSDP2, also when the ranks run different numbers of rows. FSDP2's ranks other than 0 never read
the model and still train exactly the one in the folder.
Launches cost seconds of imports each, so every gradient the tests compare is computed once, by one launch of
2 processes and one of 1 (module fixtures), and the tests compare them."""
import json
import os

import pytest
import torch

from conftest import ROOT, launcher, run

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "tests", "grad_invariance.py")
SPLITS = [  # (loss type, settings): the gradient of each must not depend on how the step is split
    ("dapo", []), ("dr_grpo", []), ("grpo", []),
    ("cispo", ["epsilon_high=5", "off_policy_mask_threshold=0.5"]),
    ("sapo", ["top_entropy_quantile=0.5", "entropy_coef=0.1"]),  # the mask's quantile and the bonus over all ranks
    ("luspo", ["importance_sampling_level=sequence"]),
    ("vespo", ["vllm_importance_sampling_mode=token_mask"]),
]
GRADIENTS = {  # every gradient the tests below compare, once each: (loss type, processes, micro-batch size, *options)
    *[(loss_type, 2, 2, *settings) for loss_type, settings in SPLITS],  # 2 accumulation steps on each of 2 ranks
    *[(loss_type, 1, 8, *settings) for loss_type, settings in SPLITS],  # one big batch
    *[(loss_type, 1, 2) for loss_type, settings in SPLITS if not settings],  # one process, 4 accumulation steps
    ("bnpo", 1, 2), ("bnpo", 1, 8),
    ("dapo", 1, 2), ("dapo", 2, 2, "checkpointing"),
    ("grpo", 1, 2, "uneven"), ("grpo", 2, 2, "uneven"), ("grpo", 2, 2, "fsdp"), ("grpo", 2, 2, "fsdp", "uneven"),
    *[("grpo", n, size, *where, step, clip) for n, size, where in ((1, 8, []), (2, 2, []), (2, 2, ["fsdp"]))
      for step, clip in (("sgd", "max_grad_norm=0.01"), ("adamw", "max_grad_norm=1.0"))],  # and the step taken
}


def launch(tmp_path, nproc: int, jobs: list[tuple]) -> dict[tuple, torch.Tensor]:
    """{job: gradient} of jobs (loss type, nproc, micro-batch size, *options), computed by one launch of
    grad_invariance.py with `nproc` processes (a fresh model for each job)."""
    files = [tmp_path / f"{nproc}-{i}.pt" for i in range(len(jobs))]
    jobs_file = tmp_path / f"jobs-{nproc}.json"
    jobs_file.write_text(json.dumps([[loss_type, micro_batch_size, str(out), *options]
                                     for (loss_type, _, micro_batch_size, *options), out in zip(jobs, files)]))
    proc = run(launcher(nproc) + [SCRIPT, str(jobs_file)], timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    started = proc.stdout.splitlines() or ["before the first job"]  # "job I: ...", printed as each starts
    assert proc.returncode == 0, f"{nproc} process(es), failed in {started[-1]}\n{proc.stderr[-4000:]}"
    return {job: torch.load(out) for job, out in zip(jobs, files)}


@pytest.fixture(scope="module")
def gradients(tmp_path_factory) -> dict[tuple, torch.Tensor]:
    """Every gradient of GRADIENTS, in two launches: one of 2 processes (DDP and FSDP2 jobs alike) and one of 1.
    The jobs are sorted, so they run in the same order in every run (a set's order changes with the hash seed)."""
    tmp_path = tmp_path_factory.mktemp("gradients")
    return {**launch(tmp_path, 2, sorted(job for job in GRADIENTS if job[1] == 2)),
            **launch(tmp_path, 1, sorted(job for job in GRADIENTS if job[1] == 1))}


@pytest.mark.parametrize("loss_type, settings", SPLITS)
def test_gradient_is_the_same_however_the_step_is_split(gradients, loss_type, settings):
    two_ranks = gradients[(loss_type, 2, 2, *settings)]  # 2 accumulation steps each
    one_batch = gradients[(loss_type, 1, 8, *settings)]
    assert one_batch.abs().max() > 1e-3  # a real gradient, not zeros
    assert (two_ranks - one_batch).abs().max() < 1e-6
    if not settings:  # one process accumulating 4 micro-batches, too
        assert (gradients[(loss_type, 1, 2)] - one_batch).abs().max() < 1e-6


def test_bnpo_depends_on_the_split(gradients):
    # bnpo averages per micro-batch token means: documented as split-dependent, and it is
    assert (gradients[("bnpo", 1, 2)] - gradients[("bnpo", 1, 8)]).abs().max() > 1e-6


def test_gradient_checkpointing_changes_memory_not_the_gradient(gradients):
    plain = gradients[("dapo", 1, 2)]
    assert (gradients[("dapo", 2, 2, "checkpointing")] - plain).abs().max() < 1e-9


def test_fsdp2_gives_the_gradient_of_one_process_also_when_ranks_run_different_rows(gradients):
    loss_type = "grpo"  # per-sequence weights: the hardest to split
    for rows in ([], ["uneven"]):
        one = gradients[(loss_type, 1, 2, *rows)]
        assert one.abs().max() > 1e-3
        assert (gradients[(loss_type, 2, 2, "fsdp", *rows)] - one).abs().max() < 1e-6, rows
        assert (gradients[(loss_type, 2, 2, *rows)] - one).abs().max() < 1e-6, rows  # DDP
    assert (gradients[(loss_type, 1, 2, "uneven")] - gradients[(loss_type, 1, 2)]).abs().max() > 1e-6


def test_clipping_and_the_optimizer_step_are_those_of_one_process_on_sharded_tensors(gradients):
    """--max_grad_norm and the AdamW step, through train.optimizer_step: one process, DDP and FSDP2 (DTensor shards)
    report the norm of the whole gradient, clip it alike and take the same step. With SGD at lr 1 the step is the
    clipped gradient itself, written out here: g min(1, c / |g|)."""
    one = gradients[("grpo", 1, 8)]
    for where in ([], ["fsdp"]):
        sgd, adamw = (gradients[("grpo", 2, 2, *where, step, clip)] for step, clip in (
            ("sgd", "max_grad_norm=0.01"), ("adamw", "max_grad_norm=1.0")))
        alone = gradients[("grpo", 1, 8, "adamw", "max_grad_norm=1.0")]
        norm = one.norm().item()
        assert norm > 0.01 and abs(sgd["norm"].item() - norm) < 1e-9 and abs(adamw["norm"].item() - norm) < 1e-9
        # (the gradients of one and two processes agree to 1e-6 in float64: summed in another order)
        assert (sgd["after"] - (sgd["before"] - one * 0.01 / norm)).abs().max() < 1e-8, where  # clipped to 0.01
        assert (adamw["before"] - alone["before"]).abs().max() == 0  # the same start
        assert (adamw["after"] - alone["after"]).abs().max() < 1e-7 < (adamw["after"] - adamw["before"]).abs().max()
    assert (gradients[("grpo", 1, 8, "sgd", "max_grad_norm=0.01")]["after"] - sgd["after"]).abs().max() < 1e-8


KEYS = """
import os
import sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from utils import sum_over_ranks


def say(text):  # one write of a whole line: the ranks share stdout, and print() may split a line in two writes
    os.write(1, (text + "\\n").encode())


dist.init_process_group("gloo")
say(str(sum_over_ranks({"a": 1, "b": dist.get_rank()})))  # the same names: summed
try:
    sum_over_ranks({"a": 1, "b": 2} if dist.get_rank() == 0 else {"b": 2, "a": 1})  # the same numbers, other order
except RuntimeError as e:
    say(f"refused: {e}")
dist.destroy_process_group()
"""


def test_sums_over_ranks_refuse_names_that_differ_between_ranks(tmp_path):
    """Values are summed by position: ranks that built their dicts in another order would mix numbers silently."""
    script = tmp_path / "keys.py"
    script.write_text(KEYS)
    proc = run(launcher(2) + [str(script), ROOT], timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("{'a': 2.0, 'b': 1.0}") == 2
    assert proc.stdout.count("refused: sum_over_ranks: the ranks summed different names") == 2  # every rank


@pytest.fixture(scope="module")
def fsdp_loads(tiny_model, tmp_path_factory):
    """One launch of fsdp_load.py (2 processes) that checks each case in turn: the model as it is, with a fresh LoRA
    adapter, and continued from a saved adapter."""
    from models import add_lora, load_model
    model = add_lora(load_model(tiny_model, "cpu"), 4, 8, 0.0, "q_proj,v_proj")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a trained adapter: it changes the logits
    adapter = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(adapter)
    return run(launcher(2) + [os.path.join(ROOT, "tests", "fsdp_load.py"), tiny_model, "plain", "lora",
                              f"adapter={adapter}"], timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("options", [[], ["lora"], ["adapter"]])
def test_fsdp2_ranks_get_their_shards_of_rank_0s_model(fsdp_loads, options):
    """Only rank 0 reads the model (the others build it on the meta device, no memory): every rank must end up
    training exactly the model in the folder, with LoRA too, fresh or continued from a saved adapter."""
    case = options[0] if options else "plain"  # its name in fsdp_load.py's lines "ok RANK CASE"
    passed = sorted(line for line in fsdp_loads.stdout.splitlines() if line.split()[2:] == [case])
    report = fsdp_loads.stdout + fsdp_loads.stderr[-4000:]  # the cases that passed, then the first one's error
    assert passed == [f"ok 0 {case}", f"ok 1 {case}"], report
    assert fsdp_loads.returncode == 0, report  # a case that fails ends the launch: the later ones are not checked
