"""Builder arguments -> ServerArgs and deployment options (no Ray cluster)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from ray_app.config import parse_app_args  # noqa: E402


def test_no_args_is_the_colocated_tiny_default():
    cfg = parse_app_args({})
    assert cfg.mode == "colocated" and cfg.server_args.model_path is None
    opts = cfg.engine_deployment_options("engine")
    assert opts["num_replicas"] == 1 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == cfg.server_args.max_running_requests


def test_command_line_strings_are_typed_like_server_args():
    cfg = parse_app_args({"dtype": "float32", "page_size": "32", "skip_warmup": "true",
                          "context_length": "none", "mode": "disaggregated",
                          "decode_min_replicas": "1", "decode_max_replicas": "3",
                          "target_ongoing_requests": "4", "max_ongoing_requests": "16",
                          "tpu_chips": "4", "downscale_delay_s": "3"})
    sa = cfg.server_args
    assert (sa.dtype, sa.page_size, sa.skip_warmup, sa.context_length) == ("float32", 32, True, None)
    dec = cfg.engine_deployment_options("decode")
    assert dec["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1,
                                         "target_ongoing_requests": 4.0, "downscale_delay_s": 3.0}
    assert dec["max_ongoing_requests"] == 16
    assert dec["ray_actor_options"]["resources"] == {"TPU": 4}
    assert cfg.engine_deployment_options("prefill")["num_replicas"] == 1


@pytest.mark.parametrize("args, match", [
    ({"no_such_flag": "1"}, "unknown argument 'no_such_flag'"),
    ({"mode": "split"}, "mode must be one of"),
    ({"page_size": "big"}, "page_size: expected int"),
    ({"skip_warmup": "maybe"}, "skip_warmup: expected a boolean"),
    ({"page_size": "0"}, "--page-size must be a positive integer"),
    ({"mode": "disaggregated", "decode_page_size": "0"}, "decode replicas: --page-size"),
    ({"prefill_dp_size": "2"}, "prefill_dp_size: role-prefixed keys need mode=disaggregated"),
    ({"mode": "disaggregated", "decode_port": "1"}, "decode_port: the Serve proxy"),
    ({"mode": "disaggregated", "prefill_mode": "colocated"}, "unknown argument 'prefill_mode'"),
    ({"mode": "disaggregated", "transport": "carrier_pigeon"}, "transport must be one of"),
    ({"mode": "disaggregated", "decode_speculative_algorithm": "NEXTN"},
     "decode replicas: --speculative-algorithm NEXTN .* the prefill replicas must run NEXTN"),
    ({"mode": "disaggregated", "prefill_enable_return_routed_experts": "true"},
     "enable_return_routed_experts is on for the prefill replicas only"),
    ({"mode": "disaggregated", "decode_enable_return_routed_experts": "true"},
     "enable_return_routed_experts is on for the decode replicas only"),
    ({"hosts_per_replica": "0"}, "hosts_per_replica must be >= 1"),
    ({"hosts_per_replica": "2", "placement_strategy": "ANYWHERE"}, "placement_strategy"),
    ({"hosts_per_replica": "2", "disable_radix_cache": "true"}, "--dp-size"),
    ({"mode": "disaggregated", "decode_hosts_per_replica": "2", "decode_tp_size": "2"},
     "decode replicas: hosts_per_replica=2: --nnodes 2 runs data-parallel"),
    ({"hosts_per_replica": "2", "dp_size": "8", "ep_size": "8", "disable_radix_cache": "true",
      "nnodes": "2", "dist_init_addr": "h:1"}, "sets nnodes"),
])
def test_bad_arguments_name_the_key(args, match):
    with pytest.raises(ValueError, match=match):
        parse_app_args(args)


def test_multi_host_replica_options():
    cfg = parse_app_args({"hosts_per_replica": "2", "dp_size": "16", "ep_size": "16",
                          "disable_radix_cache": "true", "tpu_chips": "4",
                          "accelerator_type": "TPU-V6E", "cpu_devices_per_host": "4"})
    opts = cfg.engine_deployment_options("engine")
    bundle = {"CPU": 1.0, "TPU": 4, "accelerator_type:TPU-V6E": 0.001}
    assert opts["placement_group_bundles"] == [bundle, dict(bundle, CPU=1)]
    assert opts["placement_group_strategy"] == "STRICT_SPREAD"  # one host per bundle
    assert opts["ray_actor_options"]["resources"] == {"TPU": 4}
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert cfg.server_args.nnodes == 1  # each replica sets its own nnodes / address
    single = parse_app_args({}).engine_deployment_options("engine")
    assert "placement_group_bundles" not in single and "runtime_env" not in single["ray_actor_options"]


def test_role_prefixed_keys_apply_to_their_role_only():
    """``prefill_`` / ``decode_`` keys reach that role's engines and replicas; unprefixed keys
    both."""
    cfg = parse_app_args({"mode": "disaggregated", "dtype": "float32", "prefill_dp_size": "4",
                          "prefill_ep_size": "4", "decode_dp_size": "2", "decode_ep_size": "2",
                          "decode_cpu_devices_per_host": "2", "prefill_num_cpus": "3",
                          "max_running_requests": "8", "decode_max_running_requests": "16"})
    pre, dec = cfg.args_for("prefill"), cfg.args_for("decode")
    assert (pre.dp_size, pre.ep_size, dec.dp_size, dec.ep_size) == (4, 4, 2, 2)
    assert pre.dtype == dec.dtype == "float32"
    assert (pre.max_running_requests, dec.max_running_requests) == (8, 16)
    assert cfg.server_args.dp_size == 1  # the unprefixed keys (the ingress's view)
    p_opts, d_opts = (cfg.engine_deployment_options(n) for n in ("prefill", "decode"))
    assert (p_opts["ray_actor_options"]["num_cpus"], d_opts["ray_actor_options"]["num_cpus"]) == (3, 1)
    assert (p_opts["max_ongoing_requests"], d_opts["max_ongoing_requests"]) == (8, 16)
    assert "runtime_env" not in p_opts["ray_actor_options"]
    assert d_opts["ray_actor_options"]["runtime_env"]["env_vars"]["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=2")
    tp = parse_app_args({"mode": "disaggregated", "prefill_tp_size": "4"})  # TP prefill, 1-device decode
    assert (tp.args_for("prefill").tp_size, tp.args_for("prefill").ep_size) == (4, 4)
    assert tp.args_for("decode").tp_size == 1
    spec = parse_app_args({"mode": "disaggregated", "decode_speculative_algorithm": "NGRAM"})
    assert (spec.args_for("prefill").speculative_algorithm,
            spec.args_for("decode").speculative_algorithm) == (None, "NGRAM")
    nextn = parse_app_args({"mode": "disaggregated", "speculative_algorithm": "NEXTN"})
    assert nextn.args_for("prefill").speculative_algorithm == "NEXTN"


def test_invalid_request_error_survives_pickling():
    """Replicas raise it; the ingress must get it back (400 with the field), not a 500."""
    import pickle

    from sglang_tpu_backend.managers.io_struct import InvalidRequestError

    e = pickle.loads(pickle.dumps(InvalidRequestError("input_ids", "token 5 is bad")))
    assert (e.field, e.message) == ("input_ids", "input_ids: token 5 is bad")


@pytest.mark.parametrize("key", ["host", "port"])
def test_proxy_address_is_not_an_app_argument(key):
    """host / port would be accepted and ignored (the Serve proxy binds http_options'): refused."""
    with pytest.raises(ValueError, match=f"{key}: the Serve proxy's address is the Serve config's "
                                         f"http_options.{key}"):
        parse_app_args({key: "8001" if key == "port" else "0.0.0.0"})


def test_keys_come_from_arguments_or_the_environment(monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    monkeypatch.delenv("SGLANG_ADMIN_API_KEY", raising=False)
    with caplog.at_level("WARNING", logger="ray_app.config"):
        sa = parse_app_args({}).server_args
    assert sa.api_key is None and sa.admin_api_key is None
    assert any("SECURITY WARNING" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("SGLANG_API_KEY", "user-env")
    monkeypatch.setenv("SGLANG_ADMIN_API_KEY", "admin-env")
    caplog.clear()
    with caplog.at_level("WARNING", logger="ray_app.config"):
        sa = parse_app_args({}).server_args
    assert (sa.api_key, sa.admin_api_key) == ("user-env", "admin-env")
    assert not any("SECURITY WARNING" in r.getMessage() for r in caplog.records)
    sa = parse_app_args({"api_key": "user-arg"}).server_args  # an argument wins
    assert (sa.api_key, sa.admin_api_key) == ("user-arg", "admin-env")
    assert sa.to_dict()["admin_api_key"] == "***"
