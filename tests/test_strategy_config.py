"""The strategy's grouped configs (strategies/config.py): construction, self-validation, one docstring per field, the
flat keywords' shim (Python, YAML, command line) and the planner's grouped output."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import warnings
from datetime import timedelta

import pytest
import yaml

from lightning_3d import Compressed3DStrategy, CompressionConfig, ParallelismConfig, PipelineConfig, RuntimeConfig
from lightning_3d.cli import group_flat_args, group_flat_config
from lightning_3d.strategies.config import FLAT_OPTIONS, GROUPS, flatten_options, nest_options
from lightning_3d.strategies.options import PipelineOptions


def grouped_strategy() -> Compressed3DStrategy:
    return Compressed3DStrategy(
        parallelism=ParallelismConfig(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True),
        pipeline=PipelineConfig(schedule="interleaved_1f1b", num_microbatches=4, layer_split=[1, 1, 1, 1]),
        compression=CompressionConfig(cb_rank=8, compressed_stages=[0]),
        runtime=RuntimeConfig(bucket_size_mb=5.0, gc_interval=None, timeout=timedelta(minutes=3)),
    )


def test_grouped_configs_build_the_strategy_and_resolve_derived_values() -> None:
    s = grouped_strategy()
    assert (s.num_microbatches, s.schedule, s.virtual_stages) == (4, "interleaved_1f1b", 2)  # 2: interleaved's default
    assert s.pipeline_layer_split == [1, 1, 1, 1] and s.pipeline.layer_split == (1, 1, 1, 1)
    assert s.sequence_parallel and s.options.sequence_parallel and s.options.bucket_size_mb == 5.0
    assert s.compression.cb_rank == 8 and s.compression.compressed_stages == (0,)
    assert s.garbage_collection.interval is None and s.runtime.timeout == timedelta(minutes=3)
    assert s.engine.num_microbatches == 4  # what the engine splits every batch into: the same resolved value


def test_num_microbatches_changes_in_one_place_and_is_checked() -> None:
    s = Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=2), pipeline=PipelineConfig(num_microbatches=2))
    s.num_microbatches = 3
    assert (s.num_microbatches, s.pipeline.num_microbatches, s.options.num_microbatches, s.engine.num_microbatches) == (3, 3, 3, 3)
    assert s.engine.options is s.options
    with pytest.raises(ValueError, match=r"`num_microbatches=0` must be a positive integer"):
        s.num_microbatches = 0
    assert s.num_microbatches == 3  # a refused value changes nothing


def test_dicts_are_accepted_for_each_group_and_equal_the_records() -> None:
    a = grouped_strategy()
    b = Compressed3DStrategy(
        parallelism={"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True},
        pipeline={"schedule": "interleaved_1f1b", "num_microbatches": 4, "layer_split": [1, 1, 1, 1]},
        compression={"cb_rank": 8, "compressed_stages": [0]},
        runtime={"bucket_size_mb": 5.0, "gc_interval": None, "timeout": timedelta(minutes=3)},
    )
    for group in GROUPS:
        assert getattr(a, group) == getattr(b, group)
    with pytest.raises(ValueError, match=r"`runtime=3` must be a RuntimeConfig \(lightning_3d.RuntimeConfig\), a dict"):
        Compressed3DStrategy(runtime=3)


def test_the_flat_keywords_still_work_with_a_warning_naming_each_new_place() -> None:
    with pytest.warns(FutureWarning) as record:
        s = Compressed3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                 schedule="interleaved_1f1b", num_microbatches=4, pipeline_layer_split=[1, 1, 1, 1],
                                 cb_rank=8, compressed_stages=[0], bucket_size_mb=5.0, gc_interval=None,
                                 timeout=timedelta(minutes=3))
    message = str(record[0].message)
    for move in ("pipeline_parallel_size -> parallelism.pipeline_parallel_size", "pipeline_layer_split ->"
                 " pipeline.layer_split", "cb_rank -> compression.cb_rank", "gc_interval -> runtime.gc_interval"):
        assert move in message
    assert record[0].filename == __file__  # points at the caller's line, not the library's
    for group in GROUPS:
        assert getattr(s, group) == getattr(grouped_strategy(), group)
    with pytest.warns(FutureWarning, match="compression -> compression.enabled"):
        assert Compressed3DStrategy(compression=False).compression.enabled is False
    with pytest.warns(FutureWarning, match="compression_seed -> compression.seed"):
        assert Compressed3DStrategy(compression_seed=3).compression.seed == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the grouped form warns nothing
        grouped_strategy()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tensor_paralel_size'; did you mean"
                                        r" 'tensor_parallel_size'"):
        Compressed3DStrategy(tensor_paralel_size=2)


@pytest.mark.parametrize("build, message", [
    (lambda: RuntimeConfig(bucket_size_mb=0), r"`bucket_size_mb=0` must be a size in MiB > 0 .*the default is 25\)"),
    (lambda: RuntimeConfig(bucket_size_mb=-5), r"`bucket_size_mb=-5` must be a size in MiB > 0"),
    (lambda: RuntimeConfig(timeout=timedelta(0)), r"`timeout=datetime.timedelta\(0\)` must be a positive"),
    (lambda: RuntimeConfig(gc_interval=0), r"`gc_interval=0` must be a positive number of optimizer steps"),
    (lambda: RuntimeConfig(on_nonfinite="warn"), r"`on_nonfinite='warn'` must be 'skip', 'raise' or 'ignore'"),
    (lambda: RuntimeConfig(memory_check="maybe"), r"`memory_check='maybe'` must be one of 'error', 'warn', 'off'"),
    (lambda: ParallelismConfig(data_parallel_size="two"), r"`data_parallel_size='two'` must be a positive integer or"
                                                          r" 'auto'"),
    (lambda: ParallelismConfig(pipeline_parallel_size=0), r"`pipeline_parallel_size=0` must be a positive integer"),
    (lambda: ParallelismConfig(context_parallel_attention="star"), r"`context_parallel_attention='star'` must be one"),
    (lambda: ParallelismConfig(sequence_parallel=True), r"sequence_parallel=True .* tensor_parallel_size=1"),
    (lambda: PipelineConfig(num_microbatches=0), r"`num_microbatches=0` must be a positive integer \(or None"),
    (lambda: PipelineConfig(virtual_stages=True), r"`virtual_stages=True` must be a positive integer"),
    (lambda: CompressionConfig(cb_rank=0), r"`cb_rank=0` must be a positive integer"),
    (lambda: CompressionConfig(enabled="no"), r"`enabled='no'` must be True or False"),
    (lambda: CompressionConfig(compressed_stages=[0, "1"]), r"`compressed_stages=\[0, '1'\]` has \['1'\]: name pipeline"),
    (lambda: CompressionConfig(sc_warmup=1.5), r"`sc_warmup=1.5` must be a number of steps"),
])
def test_each_config_refuses_its_bad_values_when_built(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_switches_refuse_non_booleans_with_a_type_error() -> None:
    for name in ("cuda_graphs", "shard_optimizer_state"):
        with pytest.raises(TypeError, match=f"`{name}='yes'` must be True or False"):
            RuntimeConfig(**{name: "yes"})


def test_checks_that_relate_two_configs_run_in_the_strategy() -> None:
    with pytest.raises(ValueError, match=r"`compressed_stages=\[3\]` has \[3\] outside \[0, 2\)"):
        Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=2),
                             compression=CompressionConfig(compressed_stages=[3]))
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs pipeline_parallel_size=1, got 2"):
        Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=2), runtime=RuntimeConfig(cuda_graphs=True))


def test_configs_are_frozen_and_keyword_only() -> None:
    config = ParallelismConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tensor_parallel_size = 2
    with pytest.raises(TypeError):
        RuntimeConfig(5.0)  # positional: refused


def _fields_without_docstring(cls: type) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    missing = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)
            if not documented:
                missing.append(node.target.id)
    return missing


@pytest.mark.parametrize("cls", list(GROUPS.values()), ids=list(GROUPS))
def test_every_field_has_its_own_docstring(cls: type) -> None:
    assert _fields_without_docstring(cls) == []


def test_every_flat_name_maps_onto_a_field_and_every_field_has_a_flat_name() -> None:
    for name, (group, field) in FLAT_OPTIONS.items():
        assert field in {f.name for f in dataclasses.fields(GROUPS[group])}, name
    placed = set(FLAT_OPTIONS.values()) | {("compression", "enabled")}
    assert placed == {(g, f.name) for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}


def test_internal_records_take_their_defaults_from_the_configs() -> None:
    """Each default is written once: the engine's record and the gradient synchronizer read the configs'."""
    from lightning_3d.distributed.grad_sync import GradientSynchronizer

    options = PipelineOptions()
    runtime = RuntimeConfig()
    for name in ("bucket_size_mb", "gradient_accumulation_fusion", "on_nonfinite", "max_consecutive_nonfinite",
                 "shard_optimizer_state", "cuda_graphs"):
        assert getattr(options, name) == getattr(runtime, name)
    assert options.schedule == PipelineConfig().schedule
    default = inspect.signature(GradientSynchronizer.__init__).parameters["bucket_size_mb"].default
    assert default == runtime.bucket_size_mb


def test_nest_and_flatten_are_inverse() -> None:
    flat = {"pipeline_parallel_size": 2, "compression": False, "cb_rank": 8, "pipeline_layer_split": [2, 2],
            "cuda_graphs": True, "compression_seed": 1}
    nested = nest_options(flat)
    assert nested == {"parallelism": {"pipeline_parallel_size": 2}, "compression": {"enabled": False, "cb_rank": 8,
                      "seed": 1}, "pipeline": {"layer_split": [2, 2]}, "runtime": {"cuda_graphs": True}}
    assert flatten_options(nested) == flat
    assert flatten_options({**nested, "accelerator": None}) == {**flat, "accelerator": None}


OLD_YAML = """\
trainer:
  strategy:
    class_path: lightning_3d.Compressed3DStrategy
    init_args:
      pipeline_parallel_size: 2   # a comment
      compression: false
      cb_rank: 8
      runtime: {gc_interval: 7}
"""


def test_old_yaml_and_command_lines_are_rewritten_into_groups(tmp_path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_YAML)
    with pytest.warns(FutureWarning, match=r"old.yaml: trainer.strategy.init_args: flat options are deprecated .*"
                                           r"pipeline_parallel_size -> parallelism.pipeline_parallel_size"):
        rewritten = yaml.safe_load(group_flat_config(str(path)))
    assert rewritten["trainer"]["strategy"]["init_args"] == {
        "runtime": {"gc_interval": 7}, "parallelism": {"pipeline_parallel_size": 2},
        "compression": {"enabled": False, "cb_rank": 8}}
    grouped = tmp_path / "new.yaml"
    grouped.write_text(yaml.safe_dump(rewritten))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert group_flat_config(str(grouped)) == str(grouped)  # grouped configs pass through untouched
    with pytest.warns(FutureWarning, match="num_microbatches -> pipeline.num_microbatches"):
        args = group_flat_args(["--trainer.strategy.num_microbatches=4", "--trainer.strategy.init_args.cb_rank", "8",
                                "--trainer.strategy.compression=false", "--trainer.strategy.parallelism.tensor_parallel_size=2",
                                "--trainer.max_steps=3"])
    assert args == ["--trainer.strategy.init_args.pipeline.num_microbatches=4",
                    "--trainer.strategy.init_args.compression.cb_rank", "8",
                    "--trainer.strategy.init_args.compression.enabled=false",
                    "--trainer.strategy.parallelism.tensor_parallel_size=2", "--trainer.max_steps=3"]


def test_the_cli_builds_the_same_strategy_from_old_and_grouped_yaml(tmp_path) -> None:
    from lightning_3d.cli import build_cli

    path = tmp_path / "old.yaml"
    path.write_text(OLD_YAML.replace("pipeline_parallel_size: 2", "num_microbatches: 2"))
    common = ["--config", "gpt_tiny", "--trainer.accelerator=cpu", "--trainer.logger=false",
              f"--trainer.default_root_dir={tmp_path}"]
    with pytest.warns(FutureWarning):
        old = build_cli([*common, "--config", str(path)], run=False).trainer.strategy
    new = build_cli([*common, "--trainer.strategy.pipeline.num_microbatches=2", "--trainer.strategy.compression.enabled=false",
                     "--trainer.strategy.compression.cb_rank=8", "--trainer.strategy.runtime.gc_interval=7"],
                    run=False).trainer.strategy
    for group in GROUPS:
        assert getattr(old, group) == getattr(new, group)
    assert new.num_microbatches == 2 and new.compression.cb_rank == 8 and not new.compression.enabled


def test_packaged_configs_use_the_grouped_form() -> None:
    from importlib import resources

    from lightning_3d.cli import packaged_configs

    for name in packaged_configs():
        doc = yaml.safe_load(resources.files("lightning_3d.recipes").joinpath("configs", f"{name}.yaml").read_text())
        init = (doc["trainer"]["strategy"] or {}).get("init_args") or {}
        assert set(init) <= set(GROUPS), (name, sorted(set(init) - set(GROUPS)))
