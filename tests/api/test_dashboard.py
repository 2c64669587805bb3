"""The operator's dashboard in a real headless browser (Debian's chromium and chromedriver, through
Selenium) against a stack on the tiny model: the pool cards fill, the throughput moves, jobs show in
the table, a clicked job's live view grows and ends with exactly the job's text, the autoscaler's
decisions are listed, and the page fits 1280x800 and a 390 px phone. Screenshots go to a directory
the test prints; with UPDATE_SCREENSHOTS=1 the 1280x800 one also replaces docs/dashboard.png.

Also: the snapshot stream is read once per tick for every client; with keys required the dashboard
answers only on the internal port, where its own events route shows any tenant's job."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from api.dashboard import LatencyWindow, quantile
from infra.autoscale import Autoscaler
from shared import metrics as m
from shared import names
from shared.jobs import STAGES
from shared.policy import PoolSignals
from shared.settings import Settings
from tests.conftest import ROOT, Stack
from tests.helpers import iter_sse, submit, until, wait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
LONG = 1000  # tokens of the job watched live (MAX_TOKENS_CAP in the test stacks)


def test_quantile_interpolates_inside_its_bucket() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None
    assert quantile(bounds, [0, 10, 0, 0], 0.5) == pytest.approx(0.15)  # half way through (0.1, 0.2]
    assert quantile(bounds, [5, 5, 0, 0], 0.99) == pytest.approx(0.198)
    assert quantile(bounds, [0, 0, 0, 3], 0.5) == 0.4  # in +Inf: the highest bound


def test_latency_window_forgets_what_is_older_than_its_span() -> None:
    w = LatencyWindow(m.TTFT, span=10.0)
    slow = {str(m.HISTOGRAMS[m.TTFT].index(10.0)): "100"}
    assert w.update(0.0, slow)["p50"] is None  # one reading: no window yet
    fast = {**slow, "0": "50"}  # then 50 first tokens under 10 ms
    assert w.update(5.0, fast)["p50"] == pytest.approx(0.005)
    later = w.update(16.0, fast)  # the fast ones are now older than the span
    assert later["p50"] is None and later["n"] == 0
    sparse = LatencyWindow(m.TTFT, span=10.0)  # readings further apart than the span: what came between them counts
    sparse.update(0.0, slow)
    assert sparse.update(30.0, fast)["n"] == 50


def _chrome(tmp: Path) -> Any:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: install Debian's chromium and chromium-driver "
                    "(`make test` does: apt-get install -y chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium missing: pip install -e '.[test]'")
    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars",
                "--window-size=1280,800", f"--user-data-dir={tmp / 'chromium-profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)


def _viewport(driver: Any, width: int, height: int, mobile: bool = False) -> None:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})


def _until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - an element being replaced, a value not there yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() not in ("", "–") else 0.0


def _record_a_decision(redis_url: str) -> None:
    """A real autoscaler, on stand-in pools and a forced lag, records its decision in the stack's Redis."""
    scaler = Autoscaler(Settings(redis_url=redis_url), redis_url, {names.TOKENIZER_POOL: (1, 3),
                                                                   names.INFERENCE_POOL: (1, 1)})
    scaler.signals = lambda: {names.TOKENIZER_POOL: PoolSignals(lag=500),  # type: ignore[method-assign]
                              names.INFERENCE_POOL: PoolSignals(lag=0, capacity_per_replica=64)}
    targets = scaler({names.TOKENIZER_POOL: 1, names.INFERENCE_POOL: 1})
    assert targets[names.TOKENIZER_POOL] == 3


def _steady_load(http: httpx.Client, seconds: float, in_flight: int) -> None:
    """Keep `in_flight` jobs of assorted lengths running for `seconds`, then leave the last ones running."""
    rng = random.Random(1)
    running: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        running = [j for j in running if http.get(f"/v1/jobs/{j}").json()["status"] in ("queued", "running")]
        while len(running) < in_flight:
            running.append(submit(http, prompt=f"Tell me about the number {rng.randint(1, 999)}.",
                                  max_tokens=rng.randint(100, 900), ignore_eos=True)["id"])
        time.sleep(0.5)


def test_dashboard_in_a_browser(tiny_stack: Stack, tmp_path: Path) -> None:
    started = time.monotonic()
    out = tmp_path / "screenshots"
    out.mkdir()
    print(f"\ndashboard screenshots: {out}")
    _record_a_decision(tiny_stack.redis_url)
    r = tiny_stack.redis()
    decision = r.xrevrange(names.SCALING_DECISIONS_STREAM, count=1)[0][1]
    assert decision["pool"] == names.TOKENIZER_POOL and (decision["from"], decision["to"]) == ("1", "3")
    assert decision["reason"].startswith("scale out 1 -> 3") and float(decision["at"]) > time.time() - 60

    from selenium.webdriver.common.by import By

    driver = _chrome(tmp_path)
    http = httpx.Client(base_url=tiny_stack.url, timeout=30)
    try:
        _viewport(driver, 1280, 800)
        driver.get(f"{tiny_stack.url}/dashboard")
        text = lambda sel: driver.find_element(By.CSS_SELECTOR, sel).text  # noqa: E731
        js = driver.execute_script

        for pool in names.POOLS:  # the pool cards fill from the heartbeats
            _until(f"a live {pool} worker", lambda p=pool: _number(text(f"#pool-{p} [data-field=workers]")) >= 1, 15)
        _until("the decision in the list", lambda: "1 → 3" in text("#decisions"), 10)
        assert "scale out 1 -> 3" in text("#decisions")

        # load: the tiny model is quick, so six jobs run beside the long one (about 6 s on 2 cores)
        others = [submit(http, prompt=f"Say something about the number {i}.", max_tokens=400, ignore_eos=True)["id"]
                  for i in range(6)]
        # the long job is opened in the live view before it can start (the inference worker paused meanwhile): on a
        # busy machine the tiny model could otherwise finish it before the browser opens the view
        tiny_stack.pause("inference")
        try:
            long_job = submit(http, prompt="Tell me a long story about the sea.", max_tokens=LONG, ignore_eos=True,
                              seed=7)["id"]
            row = f'#jobs tr[data-job="{long_job}"]'

            def open_row() -> None:
                """The long job's row clicked as the element it is: a click at its centre lands on whichever row the
                next snapshot moved there meanwhile (the table keeps the newest first), which once opened a 4-token
                job's live view; the page's own click handler opens it either way."""
                js("arguments[0].click()", driver.find_element(By.CSS_SELECTOR, row))
                _until("the long job in the live view", lambda: text("#live-id") == long_job, 10)

            _until("the long job in the jobs table", lambda: driver.find_elements(By.CSS_SELECTOR, row), 10)
            open_row()
        finally:
            tiny_stack.resume("inference")

        # the live view: the long job's text grows while it runs. The worker is held again once the job has its first
        # tokens, so that the page's first look finds it running (on a busy machine the tiny model could otherwise
        # end it before the browser looks)
        live_text = lambda: js("return document.getElementById('live-text').textContent")  # noqa: E731
        until("the long job's first tokens", lambda: http.get(f"/v1/jobs/{long_job}").json().get("text"), timeout=30)
        tiny_stack.pause("inference")
        try:
            first = _until("the first tokens in the live view, the job running",
                           lambda: text("#live-status").startswith("running") and len(live_text()), 15)
        finally:
            tiny_stack.resume("inference")
        _until("the live text to grow", lambda: len(live_text()) > first, 10)
        driver.save_screenshot(str(out / "dashboard-1280x800-live.png"))
        _until("tokens/s above 0", lambda: _number(text("#stat-tokens-rate")) > 0, 15)
        _until("the tenants' share in the fair-queue table", lambda: "(no key)" in text("#tenants"), 10)
        # the tiles cover the last WINDOW_S (15 s): on a loaded machine the jobs above may have had their first tokens
        # longer ago than that, and a first token can age out of the window before a slow page shows it, so a short
        # job runs now, up to three times (a few tokens: ITL too, should the long job be done)
        for attempt in range(3):
            wait(http, submit(http, prompt="Hi.", max_tokens=4, ignore_eos=True)["id"], timeout=30)
            try:
                _until("TTFT and ITL in the tiles", lambda: "–" not in text("#stat-ttft") + text("#stat-itl"), 10)
                break
            except AssertionError as exc:  # what the page showed (and when), what the API's histograms held
                if attempt < 2:
                    continue
                tiles = js("return [...document.querySelectorAll('#stat-ttft, #stat-itl')].map("
                           "e => e.textContent + ' (' + e.parentElement.title + ')')")
                hists = {n: tiny_stack.redis().hgetall(names.hist_key(n)) for n in (m.TTFT, m.ITL)}
                shown = f"snapshot at {text('#clock')}, connection {text('#conn')}, now {time.strftime('%H:%M:%S')}"
                raise AssertionError(f"{exc}: tiles {tiles}; {shown}; histograms {hists}") from None

        # the page under load, without the live view
        driver.find_element(By.ID, "live-close").click()
        assert not driver.find_element(By.ID, "live").is_displayed()
        shot = out / "dashboard-1280x800.png"
        driver.save_screenshot(str(shot))
        assert js("return document.documentElement.scrollWidth") <= 1280

        # opened again, the live view replays what came and goes on; it ends with exactly the job's text
        open_row()
        print(f"the page under load after {time.monotonic() - started:.1f}s")
        _until("the live view's done", lambda: text("#live-status").startswith("succeeded"), 90)
        print(f"the long job done after {time.monotonic() - started:.1f}s")
        job = wait(http, long_job)
        assert live_text() == job["text"] and job["usage"]["completion_tokens"] == LONG
        stage_names = ("return [...document.querySelectorAll('#live-stage-list li')]"
                       ".map(li => li.firstChild.textContent)")
        _until("the ended job's timeline", lambda: len(js(stage_names)) == len(STAGES), 10)
        assert js(stage_names) == [s for s, _, _ in STAGES]
        assert text("#live-trace") == "not traced"  # (the shared stacks export no traces)
        for job_id in others:
            wait(http, job_id)
        _until("a finished job in the table",
               lambda: driver.find_elements(By.CSS_SELECTOR, '#jobs tr[data-status="succeeded"]'), 10)
        _until("7 jobs ended in the tiles", lambda: _number(text("#stat-jobs-ended")) >= 7, 5)

        driver.find_element(By.ID, "live-close").click()
        _viewport(driver, 390, 844, mobile=True)
        time.sleep(0.5)
        assert js("return document.documentElement.scrollWidth") <= 390, "the page is wider than a phone"
        driver.save_screenshot(str(out / "dashboard-390x844.png"))
        driver.find_element(By.CSS_SELECTOR, '#jobs tr[data-status="succeeded"]').click()
        _until("a finished job's text replayed", lambda: text("#live-status").startswith("succeeded"), 10)
        driver.save_screenshot(str(out / "dashboard-390x844-live.png"))

        if os.environ.get("UPDATE_SCREENSHOTS") == "1":  # docs/dashboard.png: a minute of load, then 1280x800
            driver.find_element(By.ID, "live-close").click()
            _viewport(driver, 1280, 800)
            _steady_load(http, seconds=60, in_flight=8)
            driver.save_screenshot(str(out / "docs-dashboard.png"))
            shutil.copy(out / "docs-dashboard.png", ROOT / "docs" / "dashboard.png")

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    except BaseException:
        driver.save_screenshot(str(out / "failure.png"))
        print(f"the page as it failed: {out / 'failure.png'}")
        raise
    finally:
        http.close()
        driver.quit()
    print(f"browser checks took {time.monotonic() - started:.1f}s")


def _snapshot_times(url: str, n: int, into: list[float]) -> None:
    with httpx.stream("GET", f"{url}/dashboard/snapshots", timeout=10) as resp:
        for ev in iter_sse(resp):
            if ev.get("event") == "snapshot":
                into.append(orjson.loads(ev["data"])["at"])
                if len(into) == n:
                    return


def test_every_open_dashboard_gets_the_same_reading(tiny_stack: Stack) -> None:
    a: list[float] = []
    b: list[float] = []
    threads = [threading.Thread(target=_snapshot_times, args=(tiny_stack.url, 4, x)) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(a) == len(b) == 4
    assert len(set(a[1:]) & set(b[1:])) >= 2, (a, b)  # the same ticks, not one reading per client
    assert all(0.5 < t2 - t1 < 2.0 for t1, t2 in zip(a[1:], a[2:])), a


async def test_with_keys_required_the_dashboard_is_internal_and_shows_any_job(tiny_stack: Stack) -> None:
    from api.main import create_app

    http = httpx.Client(base_url=tiny_stack.url, timeout=30)
    job = wait(http, submit(http, prompt="Hello there.", max_tokens=12)["id"])
    http.close()
    port = 18_000
    settings = Settings(redis_url=tiny_stack.redis_url, auth="required", host="127.0.0.1", port=port,
                        internal_port=port + 1, model=tiny_stack.env["MODEL"])
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}") as public, \
                httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port + 1}") as internal:
            for path in ("/dashboard", "/dashboard/static/dashboard.js", f"/dashboard/jobs/{job['id']}/events"):
                assert (await public.get(path)).status_code == 404, path
            assert (await public.get(f"/v1/jobs/{job['id']}/events")).status_code == 401
            page = await internal.get("/dashboard")
            assert page.status_code == 200 and "dashboard.js" in page.text
            assert (await internal.get("/dashboard/static/vendor/uplot/LICENSE")).status_code == 200
            assert (await internal.get("/dashboard/static/../guard.py")).status_code == 404
            assert (await internal.get("/dashboard/jobs/job_nope/events")).status_code == 404
            # past an event id's 64 bits: a 400, where Redis's refusal was taken for an outage and the stream cut
            resp = await internal.get(f"/dashboard/jobs/{job['id']}/events", params={"after": 2**64})
            assert resp.status_code in (400, 422) and "after" in resp.text, resp.text
            resp = await internal.get(f"/dashboard/jobs/{job['id']}/events")
            assert resp.status_code == 200
            events = list(iter_sse(_Lines(resp.text)))  # type: ignore[arg-type]
            tokens = "".join(orjson.loads(e["data"])["text"] for e in events if e.get("event") == "token")
            assert events[-1]["event"] == "done" and tokens == job["text"]


class _Lines:
    """A finished response body as iter_sse reads a live one."""

    def __init__(self, body: str) -> None:
        self.body = body

    def iter_lines(self) -> Iterator[str]:
        yield from self.body.splitlines()
        yield ""
