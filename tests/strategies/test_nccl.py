"""NCCL presets on fake /sys and /proc trees: the exact variables each sets; user variables win; DDP timeouts."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_accel.strategies import DDPStrategy, default_route_interface, nccl_plan

ROUTE = (
    "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
    "ib0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
    "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\n"
)


def _tree(tmp_path: Path, ports: dict[str, tuple[str, str]] | None = None, route: str | None = ROUTE) -> Path:
    for device, (state, link_layer) in (ports or {}).items():
        port = tmp_path / "sys/class/infiniband" / device / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "link_layer").write_text(link_layer + "\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    if route is not None:
        (tmp_path / "proc/net").mkdir(parents=True)
        (tmp_path / "proc/net/route").write_text(route)
    return tmp_path


IB = {"mlx5_0": ("4: ACTIVE", "InfiniBand"), "mlx5_1": ("1: DOWN", "InfiniBand")}
ROCE = {"mlx5_2": ("4: ACTIVE", "Ethernet")}
ASYNC = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


@pytest.mark.parametrize(
    ("preset", "ports", "nodes", "expected"),
    [
        ("none", IB, 2, {}),
        ("auto", IB, 1, {**ASYNC, "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0"}),
        ("auto", ROCE, 2, {**ASYNC, "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_2"}),
        ("auto", None, 1, ASYNC),
        ("auto", None, 2, {**ASYNC, "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}),
        ("ib", IB, 2, {**ASYNC, "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0"}),
        ("socket", IB, 1, {**ASYNC, "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}),
        ("nvls_off", IB, 1, {"NCCL_NVLS_ENABLE": "0"}),
    ],
)
def test_each_preset_sets_exactly(tmp_path: Path, preset: str, ports, nodes: int, expected: dict[str, str]) -> None:
    plan = nccl_plan(preset, root=_tree(tmp_path, ports), env={}, num_nodes=nodes)
    assert plan.set == expected
    assert plan.kept == {}


def test_debug_sets_the_flight_recorder_into_the_run_directory(tmp_path: Path) -> None:
    plan = nccl_plan("debug", root=_tree(tmp_path), env={}, trace_dir="/runs/r1")
    assert plan.set == {
        **ASYNC,
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/r1/nccl_trace_rank_",
    }


def test_socket_interface_given_or_fallback(tmp_path: Path) -> None:
    assert nccl_plan("socket", root=_tree(tmp_path), env={}, socket_ifname="bond0").set["NCCL_SOCKET_IFNAME"] == "bond0"
    bare = tmp_path / "bare"
    bare.mkdir()
    assert default_route_interface(bare) is None
    assert nccl_plan("socket", root=bare, env={}).set["NCCL_SOCKET_IFNAME"] == "^lo,docker"


def test_ib_without_an_active_port_is_an_error_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`preset='ib'` needs an ACTIVE .* mlx5_1:1 DOWN; use `preset='socket'`"):
        nccl_plan("ib", root=_tree(tmp_path, {"mlx5_1": ("1: DOWN", "InfiniBand")}), env={})
    with pytest.raises(ValueError, match="is not an NCCL preset"):
        nccl_plan("fast", root=tmp_path, env={})


def test_variables_you_set_win(tmp_path: Path) -> None:
    env = {"NCCL_IB_HCA": "mlx5_9", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    plan = nccl_plan("auto", root=_tree(tmp_path, IB), env=env)
    assert plan.set == {"NCCL_IB_DISABLE": "0"}
    assert plan.kept == env
    plan.apply(env)
    assert env == {"NCCL_IB_HCA": "mlx5_9", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_IB_DISABLE": "0"}
    assert "kept yours: TORCH_NCCL_ASYNC_ERROR_HANDLING=3, NCCL_IB_HCA=mlx5_9" in plan.describe()


def test_apply_nccl_only_on_cuda_runs(compose_train, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lightning_accel import compose

    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose_train(["nccl=nvls_off", "trainer.accelerator=cpu"])
    assert compose.apply_nccl(cfg) is None
    monkeypatch.setattr(compose, "runs_on_cuda", lambda cfg: True)
    plan = compose.apply_nccl(cfg)
    assert plan is not None and plan.set == {"NCCL_NVLS_ENABLE": "0"}
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.delenv("NCCL_NVLS_ENABLE")


def test_ddp_strategy_joins_with_the_init_timeout_then_sets_the_collective_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch.strategies.ddp as lightning_ddp

    seen: dict[str, timedelta] = {}
    init = lightning_ddp._init_dist_connection

    def spy_init(*args, **kwargs):
        seen["init"] = kwargs["timeout"]
        return init(*args, **kwargs)

    monkeypatch.setattr(lightning_ddp, "_init_dist_connection", spy_init)
    set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    monkeypatch.setattr(
        torch.distributed.distributed_c10d,
        "_set_pg_timeout",
        lambda t, group=None: (seen.__setitem__("collective", t), set_timeout(t, group)),
    )
    strategy = DDPStrategy(init_timeout_s=120, timeout_s=45)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    try:
        trainer.fit(model)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert seen == {"init": timedelta(seconds=120), "collective": timedelta(seconds=45)}
    with pytest.raises(ValueError, match="`timeout_s=0` must be a positive number of seconds"):
        DDPStrategy(timeout_s=0)


def test_ddp_strategy_accepts_lightnings_timeout_and_refuses_a_clash() -> None:
    """Lightning's own `timeout` argument (Python and LightningCLI) sets the collective timeout, as `timeout_s`."""
    assert DDPStrategy(timeout=timedelta(seconds=90)).collective_timeout == timedelta(seconds=90)
    assert DDPStrategy(timeout=30).collective_timeout == timedelta(seconds=30)
    assert DDPStrategy().collective_timeout == timedelta(seconds=1800)
    with pytest.raises(ValueError, match="both set the collective timeout"):
        DDPStrategy(timeout=timedelta(seconds=90), timeout_s=60)
    with pytest.raises(ValueError, match="`timeout=-1` must be a positive number of seconds"):
        DDPStrategy(timeout=-1)


def test_two_same_process_jobs_see_only_their_own_nccl_variables(compose_train, monkeypatch) -> None:
    """A same-process multirun (`-m nccl=nvls_off,socket`): job 2 inherited job 1's NCCL_* and reported them as
    "kept yours". Each job's variables are removed when it ends; the user's own stay."""
    import os
    from contextlib import ExitStack

    from lightning_accel import compose

    for key in [k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the user's own
    monkeypatch.setattr(compose, "runs_on_cuda", lambda cfg: True)
    with ExitStack() as job:
        first = compose.apply_nccl(compose_train(["nccl=nvls_off"]), job)
        assert first is not None and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_NVLS_ENABLE" not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"
    with ExitStack() as job:
        second = compose.apply_nccl(compose_train(["nccl=socket"]), job)
        assert second is not None and "NCCL_NVLS_ENABLE" not in os.environ
        assert second.kept == {k: v for k, v in second.kept.items() if k == "NCCL_DEBUG"}  # only the user's
    assert not [k for k in os.environ if k.startswith(("NCCL_", "TORCH_NCCL_")) and k != "NCCL_DEBUG"]


def test_accel_train_names_the_nccl_preset_by_its_config_path(compose_train, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nccl_plan(preset="ib")` says `preset='ib'`; from a config the same error says `nccl.preset='ib'`."""
    from lightning_accel import compose
    from lightning_accel.errors import ConfigError

    monkeypatch.setattr(compose, "runs_on_cuda", lambda cfg: True)
    monkeypatch.setattr("lightning_accel.strategies.nccl.read_infiniband", lambda root: [])  # no RDMA port here
    with pytest.raises(ConfigError, match=r"^`nccl.preset='ib'` needs an ACTIVE InfiniBand/RoCE port"):
        compose.apply_nccl(compose_train(["nccl=ib"]))
