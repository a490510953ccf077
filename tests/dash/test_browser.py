"""A real browser sees it: two real jobs (a 2-rank CPU DDP run and a single-process run, each with a fake NVML of two
GPUs with GPM), a real accel-dash, and headless Chromium (Debian's `chromium`, driven by Playwright) reading the page.

It checks that both jobs are listed with their hosts, ranks and cards; that the values change between two reads; that
the SIGKILLed job turns stale within the timeout and the one that ends says finished; that the hostile run name is
text; that this host's card that no job holds is shown with its process; and that the page asks nothing of any other
machine. It saves a screenshot (`ACCEL_DASH_SCREENSHOT=<path>` writes it there too: the README's is taken so).

Without chromium or Playwright it skips, saying what to install; under `ACCEL_REQUIRE_TOOLS=1` (CI) it fails instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from _dash_server import dash_server
from _jobs import DDP2, job, kill, log_of
from _tools import missing, tool
from _wait import wait_until

from lightning_accel.telemetry.heartbeat import read_heartbeats

HOSTILE = "<img src=x onerror=alert(1)>"
STALE_AFTER_S = 5.0
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
]


def _playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright", "the Python package that drives Chromium")
    return sync_playwright


def _jobs_running(runs: Path, count: int) -> list[dict[str, Any]] | None:
    jobs = [job.heartbeat for job in read_heartbeats(runs)[0] if job.status == "running"]
    running = [j for j in jobs if j["step"] > 0 and j["gpus"] and j["gpus"][0]["latest"]]
    return running if len(running) >= count else None


def _job_view(page: Any, run_name: str) -> dict[str, Any]:
    """What the page shows of the job named `run_name` (as text, read back from the DOM)."""
    return page.evaluate(
        """(name) => {
            const job = [...document.querySelectorAll("article.job")]
                .find((a) => a.querySelector(".job-name").textContent === name);
            if (!job) return null;
            const cards = [...job.querySelectorAll(".card")].map((c) => ({
                uuid: c.dataset.uuid,
                sm: c.querySelector(".sm-active")?.textContent,
                tensor: c.querySelector(".tensor-active")?.textContent,
                power: c.querySelector(".power")?.textContent,
                temperature: c.querySelector(".temperature")?.textContent,
                memory: c.querySelector(".memory")?.textContent,
                energy: c.querySelector(".energy")?.textContent,
                points: [...c.querySelectorAll(".sparkline")].map((s) => Number(s.dataset.points)),
            }));
            return {status: job.dataset.status, host: job.dataset.host,
                    section: job.closest("section.host").dataset.host, step: job.querySelector(".step").textContent,
                    rate: job.querySelector(".samples-per-s").textContent,
                    ranks: job.querySelector(".ranks").textContent, cards: cards,
                    name_html: job.querySelector(".job-name").innerHTML};
        }""",
        run_name,
    )


@pytest.mark.slow
def test_a_real_browser_sees_every_job_live(tmp_path: Path) -> None:
    chromium = tool("chromium", "chromium-browser")
    sync_playwright = _playwright()
    runs = tmp_path / "runs"
    host = socket.gethostname()
    ddp_overrides = [*DDP2, "callbacks.gpu_monitor.run_name=ddp-job", "data.read_delay_ms=4"]
    single_overrides = [
        f"callbacks.gpu_monitor.run_name='{HOSTILE}'",
        "data.read_delay_ms=4",
        "+trainer.max_time=00:00:00:30",
    ]
    runs.mkdir()
    (runs / "torn.somewhere.0.json").write_text('{"schema": "lightning_accel.heartbeat/1", "run_')  # a torn file
    with (
        job(tmp_path / "ddp", runs, "a", ddp_overrides) as ddp,
        job(tmp_path / "single", runs, "b", single_overrides) as single,
        dash_server(
            ["--runs-dir", str(runs), "--stale-after", str(STALE_AFTER_S)],
            module="_fake_dash",
            env={"ACCEL_FAKE_GPUS": "ab", "ACCEL_FAKE_PID": str(os.getpid())},
        ) as (url, _),
    ):
        wait_until(
            lambda: _jobs_running(runs, 2),
            timeout_s=180,
            what="both jobs to train and publish",
            detail=lambda: log_of(tmp_path / "ddp") + log_of(tmp_path / "single"),
        )
        requests: list[str] = []
        dialogs: list[str] = []
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.on("request", lambda request: requests.append(request.url))
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.goto(url + "/")
            # (polled from here: Playwright's wait_for_function evaluates strings, which the page's CSP forbids)
            wait_until(
                lambda: page.locator("article.job[data-status=running]").count() >= 2,
                timeout_s=90,  # a loaded machine: the page's first fetches wait behind both jobs' training
                what="the page to list both jobs running",
            )

            # both jobs, with their host, ranks and cards
            ddp_view, single_view = _job_view(page, "ddp-job"), _job_view(page, HOSTILE)
            assert ddp_view["host"] == ddp_view["section"] == host == single_view["section"]
            assert ddp_view["ranks"] == "0 → cpu, 1 → cpu" and single_view["ranks"] == "0 → cpu"
            assert [c["uuid"][:6] for c in ddp_view["cards"]] == ["GPU-a0", "GPU-a1"]
            assert [c["uuid"][:6] for c in single_view["cards"]] == ["GPU-b0", "GPU-b1"]
            assert all(
                c["sm"].endswith("%") and c["power"] in ("300 / 700 W", "350 / 700 W")
                for c in ddp_view["cards"] + single_view["cards"]
            )
            assert single_view["name_html"] == "&lt;img src=x onerror=alert(1)&gt;"  # text, not an element
            assert page.locator("article.job img").count() == 0 and dialogs == []
            notes = page.locator("#notes li").all_inner_texts()  # the page serves the rest, and says what it skipped
            assert len(notes) == 1 and notes[0].startswith("skipped torn.somewhere.0.json: it is not valid JSON")

            # this host's card that no job of ours holds, with its process and user
            free = page.locator("table.free tr[data-uuid]")
            assert [free.nth(i).get_attribute("data-uuid")[:6] for i in range(free.count())] == ["GPU-zz"]
            assert str(os.getpid()) in free.first.locator("td.processes").inner_text()

            # the values move between two reads
            first = _job_view(page, "ddp-job")
            time.sleep(2.5)
            second = wait_until(
                lambda: (view := _job_view(page, "ddp-job"))["step"] != first["step"] and view,
                timeout_s=20,
                what="the DDP job's step to move on the page",
            )
            assert [(c["sm"], c["tensor"], c["temperature"], c["energy"]) for c in second["cards"]] != [
                (c["sm"], c["tensor"], c["temperature"], c["energy"]) for c in first["cards"]
            ]
            wait_until(
                lambda: max(_job_view(page, HOSTILE)["cards"][0]["points"]) >= 2,
                timeout_s=30,
                what="the sparklines to hold two points",
            )
            shot = tmp_path / "accel-dash.png"
            page.screenshot(path=str(shot), full_page=True)
            if os.environ.get("ACCEL_DASH_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["ACCEL_DASH_SCREENSHOT"])

            # a SIGKILLed job turns stale within the timeout
            kill(ddp)
            killed_at = time.monotonic()
            wait_until(
                lambda: _job_view(page, "ddp-job")["status"] == "stale",
                timeout_s=STALE_AFTER_S + 15,
                what="the killed job to read stale",
            )
            assert time.monotonic() - killed_at < STALE_AFTER_S + 2 * 2.0 + 3.0  # timeout + two refreshes + slack

            # a job that ends says finished
            single.wait(timeout=120)
            assert single.returncode == 0, log_of(tmp_path / "single")
            wait_until(
                lambda: _job_view(page, HOSTILE)["status"] == "finished",
                timeout_s=15,
                what="the ended job to read finished",
            )
            browser.close()
    # nothing but accel-dash itself was asked for
    origin = urlsplit(url)
    assert requests and all(urlsplit(r).netloc == origin.netloc and urlsplit(r).scheme == "http" for r in requests), (
        requests
    )
    assert {urlsplit(r).path for r in requests} >= {"/", "/api/state", "/static/dash.js", "/static/uPlot.iife.min.js"}


IDLE_AFTER_S = 10.0
HEARTBEAT_S = 2.0  # the job's publish interval, accel-train's default
PAGE_REFRESH_S = 2.0  # dash.js polls /api/state this often


def _idle_rows(page: Any) -> list[dict[str, str]]:
    return page.evaluate(
        """() => document.getElementById("idle-section").hidden ? [] :
            [...document.querySelectorAll("#idle tr[data-uuid]")].map((r) => ({
                uuid: r.dataset.uuid, host: r.dataset.host, owner: r.querySelector(".owner").textContent,
                holder: r.querySelector(".holder").textContent, for: r.querySelector(".for").textContent}))"""
    )


@pytest.mark.slow
def test_a_real_browser_sees_a_card_held_idle_flagged_with_its_owner_and_cleared_when_it_works(
    tmp_path: Path,
) -> None:
    """The fake NVML scripts the job's cards idle (the file `ACCEL_FAKE_IDLE_FILE` names exists) while the job holds
    their memory: with the threshold at 10 s, the page flags both cards within the threshold and two heartbeats (and
    one page refresh), with the job's owner and the duration, and the flag clears when the cards work again."""
    import getpass

    chromium = tool("chromium", "chromium-browser")
    sync_playwright = _playwright()
    runs, idle_file = tmp_path / "runs", tmp_path / "idle"
    overrides = [
        "callbacks.gpu_monitor.run_name=idle-job",
        f"callbacks.gpu_monitor.publish_interval_s={HEARTBEAT_S}",
        "data.read_delay_ms=4",
        "+trainer.max_time=00:00:03:00",
    ]
    runs.mkdir()
    with (
        job(tmp_path / "job", runs, "c", overrides, env={"ACCEL_FAKE_IDLE_FILE": str(idle_file)}) as trained,
        dash_server(
            ["--runs-dir", str(runs), "--idle-after", str(IDLE_AFTER_S), "--idle-pct", "5"],
            module="_fake_dash",
            env={"ACCEL_FAKE_GPUS": "c"},
        ) as (url, _),
        sync_playwright() as playwright,
    ):
        wait_until(
            lambda: _jobs_running(runs, 1),
            timeout_s=180,
            what="the job to train and publish",
            detail=lambda: log_of(tmp_path / "job"),
        )
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_context(viewport={"width": 1400, "height": 1100}).new_page()
        page.goto(url + "/")
        wait_until(lambda: page.locator("article.job[data-status=running]").count() >= 1, 90, "the job on the page")
        time.sleep(IDLE_AFTER_S + HEARTBEAT_S)
        assert _idle_rows(page) == []  # working: never flagged

        idle_file.touch()
        idle_at = time.monotonic()
        rows = wait_until(lambda: len(_idle_rows(page)) == 2 and _idle_rows(page), 60, "the idle cards flagged")
        flagged_after_s = time.monotonic() - idle_at
        print(f"flagged {flagged_after_s:.1f} s after the cards went idle (threshold {IDLE_AFTER_S:.0f} s)")
        assert flagged_after_s <= IDLE_AFTER_S + 2 * HEARTBEAT_S + PAGE_REFRESH_S, flagged_after_s
        assert sorted(r["uuid"][:6] for r in rows) == ["GPU-c0", "GPU-c1"]
        assert {(r["owner"], r["host"]) for r in rows} == {(getpass.getuser(), socket.gethostname())}
        assert all(r["holder"].startswith("idle-job ") and r["for"].startswith("0 min 1") for r in rows), rows
        shot = tmp_path / "accel-dash-idle.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("ACCEL_DASH_IDLE_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["ACCEL_DASH_IDLE_SCREENSHOT"])

        idle_file.unlink()
        busy_at = time.monotonic()
        wait_until(lambda: _idle_rows(page) == [], 30, "the flag to clear once the cards work again")
        cleared_after_s = time.monotonic() - busy_at
        print(f"cleared {cleared_after_s:.1f} s after the cards worked again")
        assert cleared_after_s <= 2 * HEARTBEAT_S + PAGE_REFRESH_S, cleared_after_s
        assert trained.poll() is None, log_of(tmp_path / "job")  # the job trained on throughout
        browser.close()


@pytest.mark.slow
def test_a_real_browser_draws_the_usage_page(tmp_path: Path) -> None:
    """Two weeks of two users' usage on two hosts (each its own database): the usage page draws a stacked bar per
    user and day, held below and idle-held above, and lists the top idle-held job."""
    from lightning_accel.dash.usage_schema import UsageObservation
    from lightning_accel.dash.usage_store import UsageStore

    chromium = tool("chromium", "chromium-browser")
    sync_playwright = _playwright()
    usage, runs = tmp_path / "usage", tmp_path / "runs"
    usage.mkdir()
    runs.mkdir()
    now = time.time()
    for host, user, idle_share in (("gpu-node-1", "ada", 0.4), ("gpu-node-2", "bob", 0.05)):
        with UsageStore(usage / f"usage-{host}.sqlite") as store:
            for day in range(14):
                at = now - (13 - day) * 86400
                cards = [
                    UsageObservation(
                        host=host,
                        user=user,
                        job=f"{user}-run{day // 7}",
                        gpu_index=i,
                        gpu_uuid=f"GPU-{i}",
                        interval_s=4 * 3600.0,
                        held_s=4 * 3600.0,
                        idle=i < 8 * idle_share,
                    )
                    for i in range(8)
                ]
                assert store.record(cards, at)
    with (
        dash_server(["--runs-dir", str(runs), "--no-host-gpus", "--no-usage"], env={"ACCEL_USAGE_DIR": str(usage)}) as (
            url,
            _,
        ),
        sync_playwright() as playwright,
    ):
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_context(viewport={"width": 1100, "height": 800}).new_page()
        page.goto(url + "/usage")
        wait_until(lambda: page.evaluate("() => document.body.dataset.loaded === '1'"), 30, "the usage page to draw")
        users = page.locator(".usage-user")
        assert [users.nth(i).get_attribute("data-user") for i in range(users.count())] == ["ada", "bob"]
        assert page.locator(".usage-user svg rect.idle-bar").count() == 2 * 30  # one per user and day of the range
        assert page.locator("#top tr td").first.inner_text() == "ada"  # the most idle-held GPU-hours
        stacks = page.evaluate(
            """() => [...document.querySelectorAll(".usage-user svg")].map((svg) => {
                const rects = [...svg.querySelectorAll("rect")]
                    .map((r) => [+r.getAttribute("y"), +r.getAttribute("height")]);
                const [busy, idle] = [rects[rects.length - 2], rects[rects.length - 1]];  // today's bar
                return {idleTop: idle[0], idleBottom: idle[0] + idle[1],
                        busyTop: busy[0], busyBottom: busy[0] + busy[1]};
            })"""
        )
        for stack in stacks:  # idle-held sits on the busy part, and the bar stands on the axis
            assert abs(stack["idleBottom"] - stack["busyTop"]) < 1e-6 and abs(stack["busyBottom"] - 120) < 1e-6, stack
        ada, bob = stacks
        assert abs((ada["idleBottom"] - ada["idleTop"]) - (ada["busyBottom"] - ada["busyTop"])) < 1e-6  # half idle
        shot = tmp_path / "accel-dash-usage.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("ACCEL_DASH_USAGE_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["ACCEL_DASH_USAGE_SCREENSHOT"])
        browser.close()
