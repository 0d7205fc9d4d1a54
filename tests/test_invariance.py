"""The gradient of one optimizer step does not depend on how the step is split: one process with 4
accumulation steps, two processes (torchrun, gloo) with 2 each, and one process with one big batch
give the same gradient in float64 (every loss type, the masks and the entropy bonus; bnpo is split-dependent by
definition), under
DDP and under FSDP2, also when the ranks run different numbers of rows. FSDP2's ranks other than 0 never read
the model and still train exactly the one in the folder."""
import os

import pytest
import torch

from conftest import ROOT, launcher, run

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "tests", "grad_invariance.py")


def gradient(tmp_path, loss_type, nproc, micro_batch_size, *extra):
    out = tmp_path / f"{loss_type}-{nproc}-{micro_batch_size}-{'-'.join(extra)}.pt"
    proc = run(launcher(nproc) + [SCRIPT, loss_type, str(micro_batch_size), str(out), *extra], timeout=300,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("loss_type, settings", [
    ("dapo", []), ("dr_grpo", []), ("grpo", []),
    ("cispo", ["epsilon_high=5", "off_policy_mask_threshold=0.5"]),
    ("sapo", ["top_entropy_quantile=0.5", "entropy_coef=0.1"]),  # the mask's quantile and the bonus over all ranks
    ("luspo", ["importance_sampling_level=sequence"]),
    ("vespo", ["vllm_importance_sampling_mode=token_mask"]),
])
def test_gradient_is_the_same_however_the_step_is_split(tmp_path, loss_type, settings):
    two_ranks = gradient(tmp_path, loss_type, 2, 2, *settings)  # 2 accumulation steps each
    one_batch = gradient(tmp_path, loss_type, 1, 8, *settings)
    assert one_batch.abs().max() > 1e-3  # a real gradient, not zeros
    assert (two_ranks - one_batch).abs().max() < 1e-6
    if not settings:  # one process accumulating 4 micro-batches, too
        assert (gradient(tmp_path, loss_type, 1, 2) - one_batch).abs().max() < 1e-6


def test_bnpo_depends_on_the_split(tmp_path):
    # bnpo averages per micro-batch token means: documented as split-dependent, and it is
    assert (gradient(tmp_path, "bnpo", 1, 2) - gradient(tmp_path, "bnpo", 1, 8)).abs().max() > 1e-6


def test_gradient_checkpointing_changes_memory_not_the_gradient(tmp_path):
    plain = gradient(tmp_path, "dapo", 1, 2)
    assert (gradient(tmp_path, "dapo", 2, 2, "checkpointing") - plain).abs().max() < 1e-9


def test_fsdp2_gives_the_gradient_of_one_process_also_when_ranks_run_different_rows(tmp_path):
    loss_type = "grpo"  # per-sequence weights: the hardest to split
    for rows in ([], ["uneven"]):
        one = gradient(tmp_path, loss_type, 1, 2, *rows)
        assert one.abs().max() > 1e-3
        assert (gradient(tmp_path, loss_type, 2, 2, "fsdp", *rows) - one).abs().max() < 1e-6, rows
        assert (gradient(tmp_path, loss_type, 2, 2, *rows) - one).abs().max() < 1e-6, rows  # DDP
    assert (gradient(tmp_path, loss_type, 1, 2, "uneven") - gradient(tmp_path, loss_type, 1, 2)).abs().max() > 1e-6


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


@pytest.mark.parametrize("options", [[], ["lora"], ["adapter"]])
def test_fsdp2_ranks_get_their_shards_of_rank_0s_model(tiny_model, tmp_path, options):
    """Only rank 0 reads the model (the others build it on the meta device, no memory): every rank must end up
    training exactly the model in the folder, with LoRA too, fresh or continued from a saved adapter."""
    if options == ["adapter"]:
        from utils import add_lora, load_model
        model = add_lora(load_model(tiny_model, "cpu"), 4, 8, 0.0, "q_proj,v_proj")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()  # a trained adapter: it changes the logits
        model.save_pretrained(tmp_path / "adapter")
        options = ["adapter", str(tmp_path / "adapter")]
    proc = run(launcher(2) + [os.path.join(ROOT, "tests", "fsdp_load.py"), tiny_model, *options], timeout=300,
               env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(proc.stdout.split()) == sorted("ok 0 ok 1".split())
