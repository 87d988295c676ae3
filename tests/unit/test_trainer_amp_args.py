"""PaddleFormers' mixed-precision arguments as paddle_cp's TrainingArguments (and pcp-train's FinetuningArguments)
take them: on a parallel layout `amp_master_grad` (with bf16/fp16) becomes `paddle_cp_master_grad` and reads False,
so PaddleFormers' own main_grad and its extra all-reduce stay off; on one rank PaddleFormers keeps its own. The
world size is faked (4 ranks, context parallel over all of them): the arguments are arithmetic, no collective."""
import pytest

pytest.importorskip("paddleformers")
pytest.importorskip("jinja2")

import paddle.distributed as dist  # noqa: E402


@pytest.fixture
def ranks(monkeypatch, tmp_path):
    def world(size):
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setenv("PADDLE_RANK_IN_NODE", "0")
        monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
        return dict(output_dir=str(tmp_path), device="cpu", context_parallel_size=size if size > 1 else -1)
    return world


def _amp(args):
    return args.bf16, args.fp16, args.amp_master_grad, args.paddle_cp_master_grad


def test_training_arguments_move_master_gradients_to_paddle_cp(ranks):
    from paddle_cp.integrations.paddleformers import TrainingArguments

    common = ranks(4)
    assert _amp(TrainingArguments(**common, bf16=True, fp16_opt_level="O2")) == (True, False, False, True)
    assert _amp(TrainingArguments(**common, fp16=True, amp_master_grad=False)) == (False, True, False, False)
    assert _amp(TrainingArguments(**common)) == (False, False, False, False)  # fp32: PaddleFormers refuses it


def test_one_rank_keeps_paddleformers_own_master_gradients(ranks):
    from paddle_cp.integrations.paddleformers import TrainingArguments

    assert _amp(TrainingArguments(**ranks(1), bf16=True, fp16_opt_level="O2")) == (True, False, True, False)


def test_pcp_train_compute_types(ranks):
    from paddle_cp.integrations.paddleformers.sft_workflow import FinetuningArguments

    common = ranks(4)
    args = FinetuningArguments(**common)  # PaddleFormers' defaults: compute_type bf16, amp_master_grad true
    assert _amp(args) == (True, False, False, True) and args.compute_type == "bf16"
    assert _amp(FinetuningArguments(**common, compute_type="fp16")) == (False, True, False, True)
    assert _amp(FinetuningArguments(**common, compute_type="float32", amp_master_grad=False)) == (False,) * 4
    with pytest.raises(ValueError, match=r"compute_type 'wint8'.*\['bf16', 'fp16', 'float32'\]"):
        FinetuningArguments(**common, compute_type="wint8")
