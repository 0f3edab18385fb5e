"""The sharding-layout benchmark: every shipped layout compiled and run on 8 simulated CPU devices (tiny model),
its documented outputs, collective bytes from the optimized HLO, fit/unbuildable reporting, the HLO parser on
handwritten programs, the synthetic batch, the CLI parser, and scripts/gpu_check.py in dry-run mode."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from _launch import load_script

from jaxrl_vlm.bench import flops as flops_lib
from jaxrl_vlm.bench import hlo
from jaxrl_vlm.bench.peak import known_peak_flops
from jaxrl_vlm.bench.sharding_bench import (
    COLUMNS,
    DOES_NOT_FIT,
    OK,
    UNBUILDABLE,
    BenchOptions,
    format_context_table,
    format_table,
    model_config,
    run_sharding_bench,
    write_outputs,
)
from jaxrl_vlm.bench.synthetic import EpisodeShape, episode_shape_for, synthetic_samples

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = sorted(str(p) for p in (ROOT / "configs" / "mesh").glob("*.yaml"))
MESH = "configs/mesh"
# One log-prob chunk per row: the step then has no multi-trip loop, so XLA's cost analysis (which counts a
# loop body once) is comparable with the analytic model FLOPs.
OVERRIDES = ["--logprob-chunk-size", "128", "--lr", "1e-3"]
OPTS = BenchOptions(model="tiny", rows=8, seq_len=128, steps=1, warmup=1)


@pytest.fixture(scope="module")
def bench8(tmp_path_factory):
    """Every layout on 8 simulated devices, written out."""
    assert len(jax.devices()) == 8
    report = run_sharding_bench(None, LAYOUTS, OPTS, overrides=OVERRIDES)
    out = tmp_path_factory.mktemp("bench8")
    return report, write_outputs(report, out)


@pytest.fixture(scope="module")
def bench1():
    """dp and fsdp_tp on a one-device mesh with 1 MiB of device memory: dp compiles (collectives, memory,
    FLOPs are read) but does not fit, so it is not run; fsdp_tp needs 2 devices and cannot be built."""
    layouts = [str(ROOT / MESH / "dp.yaml"), str(ROOT / MESH / "fsdp_tp.yaml")]
    opts = dataclasses.replace(OPTS, device_memory_bytes=2**20, measure_peak=False)
    return run_sharding_bench(None, layouts, opts, overrides=OVERRIDES, devices=jax.devices()[:1])


def _by_layout(report):
    return {r.layout: r for r in report.results}


def _axes(result) -> set[str]:
    """Mesh-axis groups that moved bytes, from the CSV-style `collective_bytes_by_axis` column."""
    return {item.split("=")[0] for item in result.collective_bytes_by_axis.split(";") if item}


# ----------------------------------------------------------------------------- the bench on devices


@pytest.mark.slow
@pytest.mark.ci_step
def test_every_shipped_layout_runs_on_8_devices_with_the_same_batch_and_gradient(bench8, bench1):
    report, _ = bench8
    rows = _by_layout(report)
    assert sorted(rows) == sorted(Path(p).stem for p in LAYOUTS)
    assert rows["dp"].mesh == "data=8,fsdp=1,expert=1,context=1,tensor=1"
    assert rows["fsdp"].mesh == "data=1,fsdp=8,expert=1,context=1,tensor=1"
    assert rows["fsdp_tp"].mesh == "data=1,fsdp=4,expert=1,context=1,tensor=2"
    assert rows["fsdp_cp"].mesh == "data=1,fsdp=4,expert=1,context=2,tensor=1"
    assert rows["tp"].mesh == "data=1,fsdp=1,expert=1,context=1,tensor=8"
    for r in report.results:
        assert r.status == OK, (r.layout, r.reason)
        assert r.step_ms > 0 and r.step_ms_min <= r.step_ms and r.compile_s > 0
        assert r.tokens_per_s == pytest.approx(r.real_tokens / (r.step_ms / 1e3))
    assert len({r.batch_shape for r in report.results}) == 1, "every layout must train on the same shapes"
    # The same train step under every layout: the gradient norm after (warm-up + 1) updates agrees
    # (lr 1e-3, so a layout that computed a different gradient would move the trajectory visibly).
    ref = rows["dp"].grad_norm
    assert ref > 0
    for r in report.results:
        assert r.grad_norm == pytest.approx(ref, rel=1e-3), r.layout
    assert _by_layout(bench1)["dp"].batch_shape == rows["dp"].batch_shape


@pytest.mark.slow
@pytest.mark.ci_step
def test_outputs_have_the_documented_columns(bench8):
    report, paths = bench8
    with open(paths["csv"]) as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        csv_rows = list(reader)
    assert [r["layout"] for r in csv_rows] == [r.layout for r in report.results]
    data = json.loads(paths["json"].read_text())
    assert tuple(data["columns"]) == COLUMNS
    for row in data["results"]:
        assert set(COLUMNS) <= set(row)
        assert set(row["collectives"]["bytes_by_kind_axis"]) == set(hlo.COLLECTIVE_KINDS)
    assert data["info"]["devices"] == 8 and data["info"]["model"] == "tiny"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 10_000
    table = format_table(report)
    assert table == paths["txt"].read_text().rstrip("\n")
    for word in ("layout", "step ms", "mem/dev MiB", "MFU", "AG MiB", "RS MiB", "AR MiB", "A2A MiB", "CP MiB"):
        assert word in table.splitlines()[1]
    for r in report.results:
        assert any(line.startswith(r.layout + " ") for line in table.splitlines())


@pytest.mark.slow
@pytest.mark.ci_step
def test_collective_bytes_zero_on_one_device_and_on_the_right_axes_when_sharded(bench8, bench1):
    rows = _by_layout(bench8[0])
    single = _by_layout(bench1)["dp"]  # compiled for one device (then found not to fit)
    assert single.collective_bytes == 0
    assert all(getattr(single, f"{k.replace('-', '_')}_bytes") == 0 for k in hlo.COLLECTIVE_KINDS)

    from jaxrl_vlm.models.hf_io import param_count

    param_bytes = rows["dp"].param_bytes
    assert param_bytes == 4 * param_count(model_config("tiny"))  # dp replicates every fp32 parameter
    # dp: no parameter gathers (the only all-gathers serve the patches, which are split over `data` too: the
    # vision attention's keys/values, and the scatter of merged image embeddings into their token slots with its
    # backward scatter-add); the gradient all-reduce over `data` moves about the model's size (XLA may reduce
    # a gradient before the op that expands it, e.g. the embedding's scatter-add, so not exactly).
    assert rows["dp"].all_gather_bytes < param_bytes
    gathers = [c["op_name"] for c in rows["dp"].collectives["top"] if c["kind"] == "all-gather"]
    assert gathers and all("bskh" in op or op.rsplit("/", 1)[-1] in ("scatter", "scatter-add", "gather")
                           for op in gathers), gathers
    assert 0.5 * param_bytes <= rows["dp"].all_reduce_bytes <= 2 * param_bytes
    assert _axes(rows["dp"]) == {"data"}
    # fsdp: every parameter is all-gathered over `fsdp` at least once per step; nothing else communicates.
    assert rows["fsdp"].collectives["bytes_by_kind_axis"]["all-gather"].get("fsdp", 0) >= param_bytes
    assert _axes(rows["fsdp"]) == {"fsdp"}
    # tp: activations are all-reduced over `tensor` only.
    assert rows["tp"].all_reduce_bytes > 0 and _axes(rows["tp"]) == {"tensor"}
    # fsdp x tp communicates over both axes.
    assert {"fsdp", "tensor"} <= {x for a in _axes(rows["fsdp_tp"]) for x in a.split("+")}
    for r in bench8[0].results:
        assert r.collective_bytes == sum(getattr(r, f"{k.replace('-', '_')}_bytes") for k in hlo.COLLECTIVE_KINDS)


@pytest.mark.slow
@pytest.mark.ci_step
def test_fsdp_gathers_weights_instead_of_all_reducing_activations(bench8):
    """The activation constraints (`models/activation_sharding.py`) make FSDP all-reduce only gradients, and use
    less memory per device than dp; without them XLA all-reduces the log-prob logits and MLP activations."""
    rows = _by_layout(bench8[0])
    param_bytes = rows["dp"].param_bytes  # the whole model (dp replicates it)
    fsdp = rows["fsdp"]
    assert fsdp.all_reduce_bytes <= 2 * param_bytes
    assert fsdp.peak_bytes < rows["dp"].peak_bytes
    opts = dataclasses.replace(OPTS, compile_only=True, measure_peak=False)
    off = run_sharding_bench(
        None, [str(ROOT / MESH / "fsdp.yaml")], opts, overrides=[*OVERRIDES, "--activation-constraints", "false"]
    ).results[0]
    assert off.all_reduce_bytes > 5 * param_bytes
    assert off.peak_bytes > 2 * fsdp.peak_bytes


@pytest.mark.slow
def test_context_sizes_split_one_rows_activations():
    """`--context-sizes`: the fsdp_cp layout at cp 1, 2 and 4 on 1, 2 and 4 devices (fsdp filled with 1), one row
    per micro-batch; the compiled per-device temporaries fall with the split (the issue asks >= 1.6x at cp 2 and
    >= 3x at cp 4 at 32k tokens; this checks the same ratios at 2k, where the T^2 attention terms weigh less)."""
    opts = dataclasses.replace(OPTS, rows=4, seq_len=2048, compile_only=True, measure_peak=False)
    report = run_sharding_bench(None, [str(ROOT / MESH / "fsdp_cp.yaml")], opts, context_sizes=[1, 2, 4],
                                overrides=["--micro-batch-size", "1", "--logprob-chunk-size", "256"])
    rows = _by_layout(report)
    assert [rows[f"fsdp_cp@cp{n}"].mesh for n in (1, 2, 4)] == [
        f"data=1,fsdp=1,expert=1,context={n},tensor=1" for n in (1, 2, 4)]
    temps = [rows[f"fsdp_cp@cp{n}"].temp_bytes for n in (1, 2, 4)]
    assert temps[0] / temps[1] >= 1.6 and temps[0] / temps[2] >= 3, temps
    table = format_context_table([report])
    assert "fsdp_cp@cp4" in table and f"{temps[0] / temps[2]:.2f}x" in table


@pytest.mark.slow
@pytest.mark.ci_step
def test_memory_and_flops_come_from_the_compiled_program(bench8, bench1):
    rows = _by_layout(bench8[0])
    single = _by_layout(bench1)["dp"]
    for r in [*bench8[0].results, single]:
        assert r.peak_bytes == r.arg_bytes + r.out_bytes - r.alias_bytes + r.temp_bytes
        assert r.alias_bytes > 0, "the train state is donated, so outputs alias it"
        assert r.arg_bytes >= r.param_bytes and r.hlo_flops > 0 and r.model_flops > 0
    for r in bench8[0].results:
        assert r.fits is True and r.device_bytes > r.peak_bytes
        assert r.tflops_per_device == pytest.approx(r.model_flops / 8 / (r.step_ms / 1e3) / 1e12)
        assert r.mfu == pytest.approx(r.tflops_per_device / r.peak_tflops_measured)
    # FSDP holds 1/8 of every parameter that has an `embed` dimension; dp holds all of them.
    assert rows["fsdp"].param_bytes < rows["dp"].param_bytes / 4
    # One device, no multi-trip loop: XLA's FLOP count (matmuls plus elementwise work, recomputed
    # log-prob chunk) is the analytic model FLOPs within a modest factor.
    assert 0.8 < single.hlo_flops / single.model_flops < 1.6


def test_layouts_that_cannot_exist_or_do_not_fit_are_reported_not_run(bench1):
    rows = _by_layout(bench1)
    r = rows["fsdp_tp"]
    assert r.status == UNBUILDABLE
    assert "divide" in r.reason and "fsdp_tp.yaml" in r.reason
    assert r.step_ms is None and r.peak_bytes is None and r.collective_bytes is None
    r = rows["dp"]
    assert r.status == DOES_NOT_FIT and r.fits is False and r.device_bytes == 2**20
    assert r.peak_bytes > 2**20 and "per device" in r.reason
    assert r.step_ms is None and r.loss is None and r.mfu is None  # nothing was allocated or run


# ----------------------------------------------------------------------------- HLO parsing

HLO = """HloModule jit_step, entry_computation_layout={(f32[4,16]{1,0})->f32[4,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,16])) -> (s32[], f32[4,16]) {
  %p = (s32[], f32[4,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[4,16]{1,0} get-tuple-element(%p), index=1
  %ag = f32[8,16]{1,0} all-gather(%v), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/while/body/dot_general" stack_frame_id=3}
  %ar = f32[4,16]{1,0} all-reduce(%v), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (s32[], f32[4,16]{1,0}) tuple(%i, %ar)
}

%cond (p.1: (s32[], f32[4,16])) -> pred[] {
  %p.1 = (s32[], f32[4,16]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%body.2 (q: (s32[], f32[2])) -> (s32[], f32[2]) {
  %q = (s32[], f32[2]{0}) parameter(0)
  %e = f32[2]{0} get-tuple-element(%q), index=1
  %ar.2 = f32[2]{0} all-reduce(%e), channel_id=9, replica_groups={}, to_apply=%add
  ROOT %t.2 = (s32[], f32[2]{0}) tuple(%i.2, %ar.2)
}

ENTRY %main (a: f32[4,16]) -> f32[4,16] {
  %a = f32[4,16]{1,0} parameter(0)
  %t0 = (s32[], f32[4,16]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[4,16]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], f32[2]{0}) while(%u), condition=%cond, body=%body.2
  %ags = ((f32[2,16]{1,0}), f32[16,16]{1,0}) all-gather-start(%a), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1','axis_2'}, dimensions={0}
  %agd = f32[16,16]{1,0} all-gather-done(%ags)
  %cp = f32[4,16]{1,0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %rs = (f32[1,16]{1,0}, bf16[2,8]{1,0}) reduce-scatter(%a, %b), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, dimensions={0}, to_apply=%add
  %noop = f32[4]{0} all-reduce(%c), channel_id=6, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  %a2a = f32[8,2]{1,0} all-to-all(%d), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %r = f32[4,16]{1,0} copy(%a)
}
"""
AXES, SIZES = ("data", "fsdp", "tensor"), (2, 2, 2)  # device id = 4 * data + 2 * fsdp + tensor


def test_hlo_collectives_bytes_executions_and_axes():
    found, unknown = hlo.find_collectives(HLO, AXES, SIZES)
    by_name = {c.name: c for c in found}
    assert unknown == 1  # %w2 has no known_trip_count
    assert by_name["ag"].executions == 3 and by_name["ag"].result_bytes == 8 * 16 * 4 and by_name["ag"].axes == "tensor"
    assert by_name["ar"].executions == 3 and by_name["ar"].axes == "data+fsdp"
    assert by_name["ar.2"].executions == 1 and by_name["ar.2"].axes == "data+fsdp+tensor"  # {} = all devices
    assert "ags" not in by_name  # async pair counted once, at the done
    assert by_name["agd"].kind == "all-gather" and by_name["agd"].result_bytes == 16 * 16 * 4
    assert by_name["agd"].axes == "fsdp+tensor" and by_name["agd"].group_size == 4
    assert by_name["cp"].axes == "tensor"
    assert by_name["rs"].result_bytes == 1 * 16 * 4 + 2 * 8 * 2 and by_name["rs"].axes == "tensor"
    assert by_name["noop"].axes == hlo.NO_COMMUNICATION
    assert by_name["a2a"].axes == "data+fsdp+tensor"

    s = hlo.summarize(found, unknown)
    assert s.bytes_by_kind == {
        "all-gather": 3 * 512 + 1024,
        "reduce-scatter": 96,
        "all-reduce": 3 * 256 + 8,  # the singleton-group all-reduce moves nothing
        "all-to-all": 64,
        "collective-permute": 256,
    }
    assert s.total_bytes == sum(s.bytes_by_kind.values())
    assert s.bytes_by_axis["tensor"] == 3 * 512 + 96 + 256
    assert s.count_by_kind["all-gather"] == 4 and s.unknown_trip_counts == 1
    assert s.top[0].name == "ag" and s.top[0].op_name == "jit(step)/while/body/dot_general"  # 3 x 512 B: the largest
    assert hlo.NO_COMMUNICATION not in {c.axes for c in s.top}


@pytest.mark.parametrize(
    "attrs, groups",
    [
        ("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("replica_groups=mesh['x'=8] {'x':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups={}", [list(range(8))]),
        ("channel_id=3, to_apply=%add", None),
    ],
)
def test_replica_group_formats(attrs, groups):
    assert hlo.replica_groups(attrs, 8) == groups


def test_shape_bytes_and_axis_attribution():
    assert hlo.shape_bytes("f32[8,64]{1,0}") == 2048
    assert hlo.shape_bytes("(bf16[3]{0}, pred[], s4[4]{0}, token[])") == 6 + 1 + 2
    assert hlo.shape_bytes("f32[<=10,2]{1,0}") == 80
    assert hlo.group_axes([[0, 1, 2, 3, 4, 5, 6, 7]], ("data", "fsdp", "tensor"), (1, 8, 1)) == "fsdp"
    assert hlo.group_axes([[0, 8]], ("data", "fsdp", "tensor"), (1, 8, 1)) == hlo.UNKNOWN_AXES
    assert hlo.group_axes(None, AXES, SIZES) == hlo.UNKNOWN_AXES


# ----------------------------------------------------------------------------- pieces


def test_synthetic_episodes_are_valid_multi_turn_groups():
    cfg = model_config("small")
    shape = episode_shape_for(512, cfg)
    samples = synthetic_samples(cfg, 8 * 512, shape=shape, seed=1)
    assert sum(len(s.tokens) for s in samples) <= 8 * 512 and len(samples) % shape.group_size == 0
    for s in samples:
        s.validate(image_token_id=cfg.image_token_id, vision_start_token_id=cfg.vision_start_token_id, merge_size=2)
        assert len(s.tokens) <= 512 and max(s.tokens) < cfg.text.vocab_size
    groups = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    for members in groups.values():
        assert len({m.reward for m in members}) == 2  # GRPO needs a non-zero advantage
        assert len({tuple(m.tokens[: m.prompt_length]) for m in members}) == 1  # one prompt per group
    observed = [m for s in samples for m in s.loss_mask]
    assert 0 in observed and 1 in observed  # observation tokens (mask 0) between model turns
    assert any(len(s.multimodal_train_inputs["image_grid_thw"]) > 1 for s in samples)  # images in observations
    assert synthetic_samples(cfg, 8 * 512, shape=shape, seed=1)[0].tokens == samples[0].tokens
    with pytest.raises(ValueError, match="exceeds the budget"):
        synthetic_samples(cfg, 10, shape=EpisodeShape(max_length=512), seed=0)


def test_model_flops_of_the_2b_config_match_6_n_d():
    """Matmul model FLOPs of the real 2B text decoder ~ 6 x (non-embedding text params + lm head) x tokens."""
    from jaxrl_vlm.models.hf_io import abstract_model
    from flax import nnx

    cfg = model_config("qwen3_vl_2b")
    state = nnx.state(abstract_model(cfg), nnx.Param)
    text_mm = sum(
        math.prod(v.get_value().shape)
        for path, v in nnx.to_flat_state(state)
        if path[0] == "layers" and len(v.get_value().shape) >= 2
    )
    tokens = 8 * 4096
    fwd = flops_lib.forward_flops(cfg, (1, 8, 4096, 0))
    expected = 2 * tokens * (text_mm + cfg.text.hidden_size * cfg.text.vocab_size)
    assert fwd["text_matmul"] == pytest.approx(expected)
    assert fwd["vision_matmul"] == 0 and fwd["vision_attention"] == 0
    assert flops_lib.train_step_flops(cfg, (1, 8, 4096, 0)) == pytest.approx(3 * sum(fwd.values()))


def test_known_peaks():
    h200 = SimpleNamespace(device_kind="NVIDIA H200")
    assert known_peak_flops(h200, "bfloat16") == 989e12
    assert known_peak_flops(SimpleNamespace(device_kind="NVIDIA H100 PCIe"), "bfloat16") == 756e12
    assert known_peak_flops(h200, "float32") is None
    assert known_peak_flops(SimpleNamespace(device_kind="cpu"), "bfloat16") is None


def test_bench_cli_parses_layouts_and_config_overrides():
    from jaxrl_vlm.cli import build_parser

    ns, rest = build_parser().parse_known_args([
        "bench", "sharding", "--config", "c.yaml", "--layouts", "a.yaml", "b.yaml", "--model", "small",
        "--steps", "2", "--micro-batch-size", "8",
    ])  # fmt: skip
    assert ns.bench_command == "sharding" and ns.layouts == ["a.yaml", "b.yaml"] and ns.model == "small"
    assert ns.steps == 2 and ns.config == "c.yaml" and rest == ["--micro-batch-size", "8"]
    assert ns.seq_len == [512] and ns.context_sizes is None
    ns, _ = build_parser().parse_known_args(["bench", "sharding", "--layouts", "a.yaml", "--seq-len", "8192", "32768",
                                             "--context-sizes", "1", "2"])
    assert ns.seq_len == [8192, 32768] and ns.context_sizes == [1, 2]


# ----------------------------------------------------------------------------- scripts/gpu_check.py


def _gpu_check_module():
    return load_script("gpu_check")


def test_gpu_check_reads_pytest_results(tmp_path):
    gc = _gpu_check_module()
    (tmp_path / "test_a.py").write_text("def test_ok():\n    pass\n\ndef test_ok2():\n    pass\n")
    (tmp_path / "test_b.py").write_text("def test_bad():\n    assert 1 == 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    good = gc.run_pytest(["test_a.py"], env, 60, cwd=tmp_path)
    assert good.ok and good.passed == 2 and good.failed == 0
    bad = gc.run_pytest(["test_a.py", "test_b.py"], env, 60, cwd=tmp_path)
    assert not bad.ok and bad.passed == 2 and bad.failed == 1 and "assert 1 == 2" in bad.tail
    env_gpu = gc.parity_env(dry_run=False)
    assert env_gpu["JAX_PLATFORMS"] == "cuda" and env_gpu["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"


@pytest.mark.slow
def test_gpu_check_dry_run_prints_one_summary_block(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--skip-parity", "--steps", "1",
         "--layouts", "configs/mesh/fsdp_tp.yaml", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("jaxrl-vlm GPU check") == 1
    for key in ("device", "parity", "train step", "sharding bench", "result"):
        assert any(line.startswith(key) for line in out.splitlines()), key
    assert "train step    : PASS" in out and "MFU" in out and "of 989 TFLOP/s" in out
    assert "fsdp_tp  unbuildable" in out and "result        : PASS" in out
    assert (tmp_path / "train_step.json").exists() and (tmp_path / "sharding_bench.csv").exists()
    step = json.loads((tmp_path / "train_step.json").read_text())["results"][0]
    assert step["status"] == OK and step["model"] == "tiny"


@pytest.mark.slow
def test_bench_runs_the_tiny_qwen2_5_vl_and_counts_its_gated_vision_blocks():
    """`--model tiny_qwen2_5_vl` (the windowed family) compiles and runs under a sharded layout; its analytic
    vision FLOPs count the gated MLP (three matrices), as the real 3B's parameter shapes say."""
    from flax import nnx

    from jaxrl_vlm.models import Qwen25VLConfig
    from jaxrl_vlm.models.hf_io import abstract_model

    opts = dataclasses.replace(OPTS, model="tiny_qwen2_5_vl")
    report = run_sharding_bench(None, [str(ROOT / MESH / "fsdp_tp.yaml")], opts, overrides=OVERRIDES)
    (result,) = report.results
    assert result.status == OK and math.isfinite(result.loss) and result.grad_norm > 0 and result.step_ms > 0
    assert result.model == "tiny_qwen2_5_vl" and result.model_flops > 0
    assert isinstance(model_config("tiny_qwen2_5_vl"), Qwen25VLConfig)

    cfg = model_config("qwen2_5_vl_3b")
    state = nnx.state(abstract_model(cfg), nnx.Param)
    block_kernels = sum(
        math.prod(v.get_value().shape)
        for path, v in nnx.to_flat_state(state)
        if path[:2] == ("visual", "blocks") and "_kernel_" in str(path[-1])
    )
    assert block_kernels == flops_lib.vision_block_weights(cfg.vision) * cfg.vision.depth
