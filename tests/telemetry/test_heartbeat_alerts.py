"""The heartbeat's own alerts: checked on the publisher's thread from the latest windows and the step counter, each
firing once per episode."""

from __future__ import annotations

from pathlib import Path

from lightning_accel.telemetry.heartbeat_alerts import HeartbeatAlerts, HeartbeatAlertSettings
from lightning_accel.telemetry.publisher import JobInfo, PublishSettings, RunPublisher


def names(checks: HeartbeatAlerts) -> list[str]:
    return [alert["name"] for alert in checks.alerts]


def test_throttling_and_memory_fire_once_per_episode_and_rearm() -> None:
    checks = HeartbeatAlerts(HeartbeatAlertSettings(max_throttle_pct=25, min_memory_headroom_pct=5))
    free = {"memory_used_mib": 1000.0, "memory_total_mib": 80000.0}
    hot = {0: {"throttle_thermal_frac": 0.6, "throttle_hw_slowdown_frac": 0.2, **free}}
    capped = {0: {"throttle_power_frac": 0.9, "throttle_any_frac": 0.9, "throttle_thermal_frac": 0.0, **free}}
    full = {0: {"throttle_thermal_frac": 0.0, "memory_used_mib": 79000.0, "memory_total_mib": 80000.0}}
    calm = {0: {"throttle_thermal_frac": 0.1, **free}}
    for step, latest in enumerate([hot, hot, calm, hot, full, full, capped, calm]):
        checks.check(float(step), step, latest)
    assert names(checks) == ["throttling", "throttling", "memory_headroom"]  # a card at its power cap: no alert
    first = checks.alerts[0]
    assert first["step"] == 0 and "GPU 0" in first["message"] and "60%" in first["message"]
    assert "1.2% of its memory free" in checks.alerts[2]["message"]


def test_a_non_finite_loss_count_that_goes_up_fires_with_the_count() -> None:
    count = [0]
    checks = HeartbeatAlerts(HeartbeatAlertSettings(), nonfinite=lambda: count[0])
    checks.check(0.0, 1, {})
    count[0] = 2
    checks.check(2.0, 2, {})
    checks.check(4.0, 3, {})
    count[0] = 3
    checks.check(6.0, 4, {})
    assert names(checks) == ["nonfinite_loss", "nonfinite_loss"]
    assert checks.alerts[0]["message"].startswith("2 more non-finite loss(es), 2 in this fit")
    assert checks.alerts[1]["message"].startswith("1 more non-finite loss(es), 3 in this fit")


def test_no_step_for_n_median_step_times_reads_as_hung_and_a_step_ends_it() -> None:
    checks = HeartbeatAlerts(HeartbeatAlertSettings(hung_after_steps=10, min_hung_s=30))
    t = 0.0
    for step in range(0, 11):  # one step per 2 s (the first, start-up, is not counted)
        checks.check(t, step, {})
        t += 2.0
    for _ in range(14):  # 28 s without a step: under 30 s
        checks.check(t, 10, {})
        t += 2.0
    assert names(checks) == []
    checks.check(t + 4.0, 10, {})
    assert names(checks) == ["no_progress"]
    assert "2.00 s" in checks.alerts[0]["message"] and checks.alerts[0]["step"] == 10
    checks.check(t + 6.0, 10, {})
    assert names(checks) == ["no_progress"]  # once per episode
    checks.check(t + 8.0, 11, {})  # a step: armed again
    checks.check(t + 80.0, 11, {})
    assert names(checks) == ["no_progress", "no_progress"]


def test_no_alert_before_a_step_time_is_known_and_none_turns_each_off() -> None:
    checks = HeartbeatAlerts(HeartbeatAlertSettings(min_hung_s=1))
    for t in range(100):
        checks.check(float(t), 0, {})  # start-up: no step yet
    assert names(checks) == []
    off = HeartbeatAlerts(
        HeartbeatAlertSettings(
            max_throttle_pct=None, min_memory_headroom_pct=None, hung_after_steps=None, nonfinite=False
        ),
        nonfinite=lambda: 5,
    )
    hot = {0: {"throttle_any_frac": 1.0, "memory_used_mib": 80000.0, "memory_total_mib": 80000.0}}
    for step in (1, 2, 3, 3, 3, 3):
        off.check(float(step * 100), step, hot)
    assert names(off) == []


def test_the_publisher_writes_them_into_the_heartbeat(tmp_path: Path) -> None:
    clock = [1000.0]
    publisher = RunPublisher(
        PublishSettings(runs_dir=tmp_path, interval_s=2.0),
        JobInfo(run_id="r", name="n", host="h", user="u", pid=1, command="c"),
        checks=HeartbeatAlerts(HeartbeatAlertSettings(hung_after_steps=3, min_hung_s=5)),
        clock=lambda: clock[0],
    )
    publisher.start(threaded=False)
    for step in (1, 2, 3, 4, 4, 4, 4, 4):
        publisher.progress.step = step
        clock[0] += 2.0
        publisher.publish()
    assert publisher.heartbeat is not None
    assert [a["name"] for a in publisher.heartbeat["alerts"]] == ["no_progress"]
    publisher.finish("finished")
