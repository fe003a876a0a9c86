"""prefill_flops' FLOP count, worked by hand for a tiny model and for the default one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.kernels import prefill_flops
from benchmarks.kernels.prefill_flops import ModelShape
from benchmarks.kernels.prefill_flops import prefill_flops as flops

TINY = ModelShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16,
                  vocab=32)


def test_the_tiny_models_projections_and_weights():
    # qkv (2 + 2 x 1) x 4 = 16 rows of 8; o 8 x 8; gate/up 2 x 16 rows of 8; down 8 x 16.
    assert TINY.projections() == [("qkv", 16, 8), ("o", 8, 8), ("gate_up", 32, 8),
                                  ("down", 8, 16)]
    # (128 + 64 + 256 + 128) per layer, 2 layers.
    assert TINY.matmul_params() == 1152


def test_the_tiny_models_prefill_flops_by_hand():
    # 3 tokens: projections 2 x 1152 x 3 = 6912; LM head 2 x 32 x 8 = 512 (last token only);
    # attention 2 x 2 x 2 layers x 2 heads x 4 dims x (1 + 2 + 3) keys = 384.
    assert flops(TINY, 3) == {"linear": 6912, "lm_head": 512, "attention": 384, "total": 7808}
    assert flops(TINY, 0)["total"] == 0


def test_smollm2_135m_at_1024_tokens():
    cfg = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                          num_key_value_heads=3, intermediate_size=1536, vocab_size=49152)
    shape = ModelShape.from_config(cfg)  # no head_dim: hidden / heads = 64
    assert shape.head_dim == 64
    assert [p[1:] for p in shape.projections()] == [(960, 576), (576, 576), (3072, 576),
                                                    (576, 1536)]
    assert shape.matmul_params() == 106_168_320
    got = flops(shape, 1024)
    assert got["linear"] == 217_432_719_360
    assert got["attention"] == 36_274_176_000
    assert got["total"] == 253_763_518_464  # the docstring's 253.8 GFLOP


def test_report_names_the_aim_and_each_share():
    path = {"seconds": 2.0, "tokens_per_s": 512.0, "gflops": 120.0,
            "share_of_square_peak": 0.6, "share_of_projection_peak": 0.75,
            "prefill_mode": "chunked", "prefill_chunk_size": 256}
    result = {"dtype": "float32", "tokens": 1024, "flops": flops(TINY, 3),
              "paths": {"backend": path, "engine": path},
              "peaks": {"square": {"size": 2048, "gflops": 200.0},
                        "projections": {"rows": 1024, "gflops": 160.0, "shapes": {
                            "qkv": {"out": 960, "in": 576, "gflops": 150.0,
                                    "best": "F.linear"}}}}}
    text = prefill_flops.format_report([result])
    assert "aim: >= 60% of the matmul peak" in text
    assert "float32 backend 75% of the projection peak (60% of the square)" in text
    assert "engine TTFT (chunked 256)" in text


@pytest.mark.parametrize("argv, message", [
    (["--dtypes", "float16"], "unknown 'float16'"),
    (["--tokens", "0"], "at least 1"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        prefill_flops.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_report_gives_the_bf16_engine_verdict_and_the_pytorch_layers_pass():
    def path(share: float) -> dict:
        return {"seconds": 1.0, "tokens_per_s": 1024.0, "gflops": 300.0,
                "share_of_square_peak": share, "share_of_projection_peak": share,
                "prefill_mode": "mixed_batch", "prefill_chunk_size": 256}

    peaks = {"square": {"size": 2048, "gflops": 400.0},
             "projections": {"rows": 1024, "gflops": 400.0, "shapes": {}}}
    for engine_share, verdict in ((0.78, "PASS"), (0.74, "MISS")):
        result = {"dtype": "bfloat16", "tokens": 1024, "flops": flops(TINY, 3), "peaks": peaks,
                  "paths": {"backend": path(0.85), "backend_torch_layers": path(0.7),
                            "engine": path(engine_share)}}
        text = prefill_flops.format_report([result])
        assert "same, PyTorch layers" in text
        assert (f"bf16 through the engine: {engine_share:.0%} of the projections' peak "
                f"(target >= 75%): {verdict}") in text
