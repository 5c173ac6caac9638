"""What PPD believes apart from what the workers are (issue 50): ``--router-profile`` and
``--router-link-bandwidth`` in `sim run` and `sim compare`, ``--link-bandwidth-gbps`` in the live
shells, and `serve`'s flags that give them to the picker or router only."""

from __future__ import annotations

import pytest

from dynamo_ppd.cli import build_parser
from dynamo_ppd.cli.sim import believed_profile
from dynamo_ppd.engine.profile import ProfileError, believed_link, link_preset, load_profile
from dynamo_ppd.routing.args import parse_args
from dynamo_ppd.routing.start import build_policy
from dynamo_ppd.sim.cluster import Cluster
from dynamo_ppd.studies import policies

pytestmark = pytest.mark.unit

CROSS = link_preset("cross-node")


def test_a_believed_link_is_the_truth_a_factor_of_it_or_gb_per_s():
    assert believed_link(None, CROSS) == believed_link("", CROSS) == CROSS
    assert believed_link("4x", CROSS).link_bandwidth_bytes_s == 4 * CROSS.link_bandwidth_bytes_s
    assert believed_link("0.25x", CROSS).link_bandwidth_bytes_s == CROSS.link_bandwidth_bytes_s / 4
    assert believed_link("12.5", CROSS).link_bandwidth_bytes_s == 12.5e9
    assert believed_link("4x", CROSS).transfer_setup_s == CROSS.transfer_setup_s
    for bad in ("x", "fast", "0", "-2x", "inf", "nan", "0x"):
        with pytest.raises(ProfileError, match="GB/s"):
            believed_link(bad, CROSS)


def _sim_args(*argv: str):
    return build_parser().parse_args(["sim", "run", "--router", "ppd", *argv])


def test_sim_run_ppd_believes_the_cluster_unless_told_otherwise():
    args = _sim_args("--link-bandwidth", "10")
    cluster = Cluster.from_config(load_profile(args.profile), args.config, link_bandwidth_bytes_s=10e9)
    # By default the workers' link, even where --link-bandwidth moved it off the profile's.
    assert believed_profile(args, cluster).transfer.link_bandwidth_bytes_s == 10e9
    args = _sim_args("--link-bandwidth", "10", "--router-link-bandwidth", "4x",
                     "--router-profile", "h100-llama3.1-8b-vllm-paper")
    belief = believed_profile(args, cluster)
    assert belief.transfer.link_bandwidth_bytes_s == 40e9
    assert belief.name == "h100-llama3.1-8b-vllm-paper" and cluster.profile.name == "h100-llama3.1-8b"


def _local_share(router_link: str) -> float:
    """PPD's decode-local share of the follow-ups of a point where the link matters, believing
    ``router_link``."""
    spec = policies.CompareSpec("h100-llama3.1-8b", "2P2D", "cross-node", "small_small_bal", 8.0, "ppd@1",
                                router_link=router_link)
    return policies.run_specs([spec])[0].local_share


def test_a_link_believed_slower_keeps_more_turns_local():
    truth, slow, fast = _local_share(""), _local_share("0.1x"), _local_share("10x")
    assert fast <= truth <= slow
    assert fast < slow


def test_sim_compare_keeps_beliefs_apart_in_its_simulation_keys():
    spec = policies.CompareSpec("h100-llama3.1-8b", "1P3D", "cross-node", "small_tiny", 1.0, "ppd@1")
    wrong = policies.CompareSpec("h100-llama3.1-8b", "1P3D", "cross-node", "small_tiny", 1.0, "ppd@1",
                                 router_link="4x")
    assert policies.simulation_key(spec) != policies.simulation_key(wrong)
    peer = policies.CompareSpec("h100-llama3.1-8b", "1P3D", "cross-node", "small_tiny", 1.0, "x0",
                                router_link="4x")
    assert policies.simulation_key(peer) == policies.simulation_key(
        policies.CompareSpec("h100-llama3.1-8b", "1P3D", "cross-node", "small_tiny", 1.0, "x0"))


def test_the_live_shells_predict_with_the_link_they_are_given():
    default = build_policy(parse_args(["--mode", "ppd"]))
    told = build_policy(parse_args(["--mode", "ppd", "--link-bandwidth-gbps", "100"]))
    assert told.predictor.link_bandwidth == 100e9
    profile_link = load_profile("h100-llama3.1-8b").transfer.link_bandwidth_bytes_s
    assert default.predictor.link_bandwidth == profile_link
    with pytest.raises(SystemExit):
        parse_args(["--link-bandwidth-gbps", "0"])


def test_sim_run_reports_ppd_prediction_errors_by_route(tmp_path, capsys):
    import json

    from dynamo_ppd.cli import main

    out = tmp_path / "run.json"
    assert main(["sim", "run", "--router", "ppd", "--config", "2P2D", "--workload", "wildchat", "--qps", "4",
                 "--duration", "20", "--router-link-bandwidth", "0.25x", "--json", str(out)]) == 0
    assert "TTFT err p50" in capsys.readouterr().out
    errors = json.loads(out.read_text())["prediction_errors"]
    local = errors["decode_local"]
    assert local["follow_ups"] > 50
    assert local["ttft_error_p10"] <= local["ttft_error_p50"] <= local["ttft_error_p90"]
    assert local["ttft_abs_error_mean"] >= 0
