"""The pieces behind reading and writing only a rank's share: the streaming safetensors writer,
byte-range reads of checkpoint boxes, export's file sharding."""
import numpy as np
import paddle
import pytest
from safetensors import safe_open

from paddle_cp.checkpoint.export import shard_files
from paddle_cp.checkpoint.format import BoxReader, merge_metadata, read_metadata, write_state
from paddle_cp.checkpoint.io_bytes import io_bytes, reset_io_bytes
from paddle_cp.checkpoint.safetensors_writer import StreamingFile
from paddle_cp.checkpoint.shards import SavedBox


def test_streaming_file_reads_back_with_safetensors(tmp_path):
    values = {"a": np.arange(12, dtype="float32").reshape(3, 4), "b": np.ones([5], "int64")}
    stream = StreamingFile(tmp_path / "x.safetensors", [("a", (3, 4), "float32"), ("b", (5,), "int64")])
    for key, value in values.items():
        stream.write(key, value)
    with safe_open(str(tmp_path / "x.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == ["a", "b"]
        for key, value in values.items():
            np.testing.assert_array_equal(f.get_tensor(key), value)
    stream = StreamingFile(tmp_path / "y.safetensors", [("a", (3, 4), "float32")])
    with pytest.raises(ValueError, match="the header expects a"):
        stream.write("a", np.ones([2, 4], "float32"))
    stream.close()


def test_region_reads_only_the_overlapping_bytes(tmp_path):
    full = np.arange(8 * 6, dtype="float32").reshape(8, 6)
    tensor = paddle.to_tensor(full)
    # two row blocks in two files, as two ranks would write them
    for name, rows in (("0_0.distcp", slice(0, 5)), ("1_0.distcp", slice(5, 8))):
        piece = paddle.to_tensor(full[rows])
        box = SavedBox((rows.start, 0), tuple(piece.shape), (8, 6), "float32", piece,
                       (slice(0, piece.shape[0]), slice(0, 6)))
        write_state(str(tmp_path), {name: {"w": box}}, copied=False)
    merge_metadata(str(tmp_path))
    reader = BoxReader(str(tmp_path), read_metadata(str(tmp_path)))
    reset_io_bytes()
    np.testing.assert_array_equal(reader.region("w", (3, 2), (4, 3)), full[3:7, 2:5])
    assert io_bytes()["read"] == 4 * 3 * 4  # the 12 elements asked for, from both files
    np.testing.assert_array_equal(reader.full("w"), tensor.numpy())
    merged = paddle.distributed.load_merged_state_dict(str(tmp_path))  # Paddle's own reader agrees
    np.testing.assert_array_equal(merged["w"].numpy(), full)


def test_export_files_follow_save_pretrained_sharding():
    outputs = [("a", (256,), "float32"), ("b", (256,), "float32"), ("c", (600,), "float32"), ("d", (1,), "float32")]
    files = shard_files(outputs, limit=2048)  # 1 KiB, 1 KiB | 2.3 KiB alone (over the limit) | 4 bytes
    assert [[key for key, _, _ in f] for f in files] == [["a", "b"], ["c"], ["d"]]


def test_bfloat16_weights_round_trip_in_one_process(tmp_path):
    """Pretrained weights are mostly bfloat16 (numpy has no such dtype): save_pretrained's files load into
    a bfloat16 model as from_pretrained loads them, and export_pretrained's load back."""
    import paddle_cp as pcp
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, fuse_rms_norm=False)
    paddle.seed(1)
    saved = LlamaForCausalLM(config)
    saved.to(dtype="bfloat16")
    saved.save_pretrained(str(tmp_path / "saved"))
    for directory in ("saved", "exported"):
        paddle.seed(2)
        model = LlamaForCausalLM(config)
        model.to(dtype="bfloat16")
        pcp.load_pretrained(model, str(tmp_path / directory))
        for key, value in saved.state_dict().items():
            assert model.state_dict()[key].dtype == paddle.bfloat16
            np.testing.assert_array_equal(model.state_dict()[key].numpy(), value.numpy())
        if directory == "saved":
            pcp.export_pretrained(model, str(tmp_path / "exported"))
