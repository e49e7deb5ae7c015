"""Planning for a cluster the profile was not measured on: ``--nodes`` and ``--regime`` (planner/cluster.py;
docs/planner.md, "Another cluster: --nodes and --regime"), from the synthetic one-GPU profile."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
from lightning_3d.costs import ProfiledCostModel, device_spec
from lightning_3d.costs.devices import nvlink_bandwidth
from lightning_3d.planner import SearchOptions, Workload, plan, predict
from lightning_3d.planner.cluster import cluster_for
from lightning_3d.planner.model import Candidate
from tests.test_planner import _tiny_cpu_config

PROFILE = Path(__file__).resolve().parent / "data" / "profiles" / "gpt_synthetic.json"
H100 = device_spec("h100")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _config(tmp_path: Path) -> dict:
    cfg = _tiny_cpu_config(tmp_path)  # the synthetic profile's model (tests/test_planner.py's CLI test)
    cfg["trainer"]["precision"] = "bf16-mixed"
    cfg["trainer"]["accelerator"] = "gpu"
    cfg["model"]["init_args"].update(num_layers=8, hidden_size=1024, num_heads=16, vocab_size=32768)
    cfg["data"]["init_args"]["seq_length"] = 1024
    return cfg


def test_the_regimes_set_the_links() -> None:
    nv = nvlink_bandwidth("h100")
    one = cluster_for(4, H100)
    assert (one.nodes, one.gpus_per_node, one.intra_node_bandwidth, one.inter_node_bandwidth) == (1, 4, nv, nv)
    two = cluster_for(16, H100, nodes=2, regime="ib")
    assert (two.nodes, two.gpus_per_node, two.intra_node_bandwidth, two.inter_node_bandwidth) == (2, 8, nv, 25e9)
    assert cluster_for(16, H100, nodes=2, regime="ib", nvlink=317e9).intra_node_bandwidth == 317e9  # measured
    eth = cluster_for(4, H100, regime="ethernet")  # one host, NCCL's direct transports off: every link slow
    assert (eth.intra_node_bandwidth, eth.inter_node_bandwidth) == (3.8e9, 3.8e9)
    assert cluster_for(16, H100, nodes=2).inter_node_bandwidth == 50e9  # a cluster file's default
    assert cluster_for(16, H100, nodes=2, regime="nvlink").inter_node_bandwidth == nv
    with pytest.raises(ValueError, match="regime='infiniband' is not a link regime; choose one of 'nvlink', 'ib'"):
        cluster_for(4, H100, regime="infiniband")
    with pytest.raises(ValueError, match="gpus=16 cannot be shared out over nodes=3"):
        cluster_for(16, H100, nodes=3)
    with pytest.raises(ValueError, match="nodes=0 must be a positive integer"):
        cluster_for(16, H100, nodes=0)


def test_a_two_node_ib_plan_from_a_one_node_profile(tmp_path) -> None:
    cfg = _config(tmp_path)
    p = plan(cfg, 16, profile=PROFILE, nodes=2, regime="ib", global_batch_size=32,
             options=SearchOptions(top_k=1, microbatch_sizes=(2,), schedules=("1f1b",)))
    assert (p.cluster.nodes, p.cluster.gpus_per_node, p.cluster.inter_node_bandwidth) == (2, 8, 25e9)
    trainer = p.configs[0]["trainer"]
    assert (trainer["num_nodes"], trainer["devices"]) == (2, 8)
    # The same candidate, its replicas across the nodes: slower on IB than on NVLink between nodes, and SC (offered
    # below sc_max_link_gbps) shortens its synchronisation there.
    cm = ProfiledCostModel(PROFILE, derive_tp=True)
    c = Candidate(16, 1, 1, 2, 1, "1f1b", 1, (8,), (False,), False)
    ib = Workload(cm.shape, 1024, 32, cm, p.cluster)
    nv = Workload(cm.shape, 1024, 32, cm, cluster_for(16, cm.device, nodes=2, regime="nvlink"))
    assert predict(c, ib).exposed_dp_time > predict(c, nv).exposed_dp_time
    assert predict(Candidate(16, 1, 1, 2, 1, "1f1b", 1, (8,), (False,), True), ib).exposed_dp_time < predict(c, ib).exposed_dp_time
    # Above eight GPUs without --nodes: nodes of eight (as a cluster without a file always was).
    assert plan(cfg, 16, profile=PROFILE, regime="ethernet", global_batch_size=32,
                options=SearchOptions(top_k=1, microbatch_sizes=(2,), schedules=("1f1b",))).cluster.nodes == 2
    with pytest.raises(ValueError, match="pass either cluster .* or nodes/regime"):
        plan(cfg, 16, profile=PROFILE, cluster=p.cluster, regime="ib")


def test_cli_plan_nodes_and_regime(tmp_path, capsys) -> None:
    from lightning_3d.cli import main

    source = tmp_path / "model.yaml"
    source.write_text(yaml.safe_dump(_config(tmp_path)))
    out = tmp_path / "plan.yaml"
    main(["plan", "--config", str(source), "--gpus", "16", "--nodes", "2", "--regime", "ib", "--profile", str(PROFILE),
          "--global-batch-size", "32", "--top-k", "1", "--time-budget", "3", "--out", str(out)])
    emitted = yaml.safe_load(out.read_text())
    assert (emitted["trainer"]["num_nodes"], emitted["trainer"]["devices"]) == (2, 8)
    assert "(2 node(s) x 8 h100)" in out.read_text()
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(source), "--gpus", "16", "--regime", "wifi", "--out", str(out)])
    assert "argument --regime: invalid choice: 'wifi'" in capsys.readouterr().err

