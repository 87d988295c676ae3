"""Checkpoints in one process (no launch): async save and wait, latest_checkpoint, export to
PaddleFormers."""
import json
import sys

import numpy as np
import paddle.distributed as dist
from launcher import WORKERS

import paddle_cp as pcp

sys.path.insert(0, str(WORKERS))
from one_card import trained  # noqa: E402
from tensor_parallel import batches  # noqa: E402


def test_one_process_async_save_latest_and_export(tmp_path):
    """No launch: async save publishes at wait_checkpoint, latest_checkpoint skips unfinished saves,
    export_pretrained loads back with PaddleFormers' from_pretrained."""
    from paddleformers.transformers import LlamaForCausalLM

    model, optimizer = trained(2)
    pcp.save_checkpoint(str(tmp_path / "a"), model, optimizer, extra={"step": 2})
    pcp.save_checkpoint(str(tmp_path / "b"), model, optimizer, extra={"step": 3}, async_save=True)
    assert pcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "a")
    pcp.wait_checkpoint()
    assert pcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "b")
    (tmp_path / "c.partial" / "model_state").mkdir(parents=True)  # a save that died
    assert pcp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "b")
    assert pcp.latest_checkpoint(str(tmp_path / "nothing")) is None
    with open(tmp_path / "b" / "pcp_checkpoint.json") as f:
        files = json.load(f)["files"]
    for folder in ("model_state", "optimizer_state"):
        assert f"{folder}/0.metadata" in files and f"{folder}/0_0.distcp" in files
        data = [name for name in files if name.startswith(folder) and name.endswith(".distcp")]
        assert all(name + ".index.json" in files for name in data)  # where each box's bytes start
        # no data file holds more than the largest box (paddle.save copies a file's worth while it pickles)
        assert max(files[name] for name in data) < 2 * 128 * 64 * 4
    optimizer_state = dist.load_merged_state_dict(str(tmp_path / "b" / "optimizer_state"))
    assert "model.layers.0.self_attn.q_proj.weight.moment1_0" in optimizer_state
    pcp.export_pretrained(model, str(tmp_path / "export"))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[key].numpy(), value.numpy())
    ids, labels = next(iter(batches("llama")))
    np.testing.assert_allclose(float(loaded(input_ids=ids, labels=labels)[0]),
                               float(model(input_ids=ids, labels=labels)[0]), rtol=0, atol=1e-5)


def test_state_dtypes_match_paddles_optimizers():
    """The dtype a checkpoint expects (and receives into) for each accumulator and master weight is the one
    Paddle creates, with and without multi_precision."""
    import paddle

    from paddle_cp.checkpoint import layout

    for dtype in ("float32", "float64", "bfloat16", "float16"):
        for make in (paddle.optimizer.AdamW, paddle.optimizer.Momentum):
            for multi_precision in (False, True):
                layer = paddle.nn.Linear(2, 2)
                layer.to(dtype=dtype)
                optimizer = make(parameters=layer.parameters(), multi_precision=multi_precision)
                optimizer._create_accumulators(paddle.static.default_main_program().global_block(),
                                               layer.parameters())
                for param in layer.parameters():
                    names = layout.state_names(optimizer, param)
                    assert (layout.MASTER_WEIGHT in names) == (multi_precision and dtype in ("bfloat16", "float16"))
                    for name in names:
                        assert layout.state_tensor(optimizer, param, name).dtype == \
                            layout.state_dtype(optimizer, param, name), (dtype, make.__name__, name, multi_precision)


def test_a_half_checkpoint_without_master_weights_loads_into_an_o2_run(tmp_path, monkeypatch):
    """A bfloat16/float16 checkpoint saved without master weights loads into an O2 run with them: each master
    weight is the fp32 copy of the loaded parameter (only an fp32 checkpoint's values are read into it)."""
    import paddle

    from workers import emulated_amp

    emulated_amp.install(monkeypatch.setattr)
    try:
        for dtype in ("bfloat16", "float16"):
            def o2(master_weight):
                paddle.seed(0)
                layer = paddle.nn.Linear(4, 4)
                optimizer = paddle.optimizer.AdamW(parameters=layer.parameters())
                return paddle.amp.decorate(layer, optimizer, level="O2", dtype=dtype, master_weight=master_weight)

            saved, optimizer = o2(master_weight=False)
            saved(paddle.randn([2, 4]).astype(dtype)).astype("float32").sum().backward()
            optimizer.step()
            pcp.save_checkpoint(str(tmp_path / dtype), saved, optimizer)
            loaded, optimizer = o2(master_weight=True)
            pcp.load_checkpoint(str(tmp_path / dtype), loaded, optimizer)
            for param, want in zip(loaded.parameters(), saved.parameters()):
                assert param.dtype == want.dtype
                master = optimizer._master_weights[param.name]
                assert master.dtype == paddle.float32
                np.testing.assert_array_equal(master.numpy(), want.astype("float32").numpy())
    finally:
        emulated_amp.reset()
