"""Headless Chromium (Debian's ``chromium`` package) driven by Python's ``playwright``,
with helpers for the pages of the Dagster UI (dagster-webserver 1.13) the tests look at.

Never ``playwright install``: we drive the system browser at ``CHROMIUM`` (the real
binary, not the ``/usr/bin/chromium`` shell wrapper).

    from harness.browser import dagster_ui
    with dagster_ui(server.url, artifacts_prefix="test_ui-") as ui:
        ui.open_lineage(group="demo")
        ui.screenshot("lineage")
        ui.open_partitions_tab(["demo", "state"])
        ui.partition_counts()   # {"Failed": 0, "Materialized": 0, "Materializing": 0, "Missing": 8}
        backfill_id = ui.launch_backfill(["demo", "state"], ["0001", "0002"])

Selectors are role/text based where the UI offers them (buttons, dialogs, menu items,
tabs) and fall back on stable attributes the UI renders (``data-tooltip`` on lineage
nodes, ``title`` on partition rows, link ``href``s); never on hashed CSS-module
class names. Screenshots go to ``tests/artifacts/`` (gitignored).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

CHROMIUM = "/usr/lib/chromium/chromium"
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "tests" / "artifacts"
INSTALL_HINT = ("the browser tests need Debian's chromium (apt-get install -y chromium) and "
                "the playwright Python package (pip install playwright; never `playwright install`)")


def browser_available() -> str | None:
    """``None`` if the browser tests can run, else why not (for ``pytest.skip``/``fail``)."""
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} missing: {INSTALL_HINT}"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"python package playwright missing: {INSTALL_HINT}"
    return None


def _key_path(asset_key: str | Sequence[str]) -> list[str]:
    return asset_key.split("/") if isinstance(asset_key, str) else [str(p) for p in asset_key]


def asset_url_path(asset_key: str | Sequence[str]) -> str:
    return "/assets/" + "/".join(urllib.parse.quote(p, safe="") for p in _key_path(asset_key))


class DagsterUI:
    """One browser page on a Dagster webserver, with the flows the tests need."""

    def __init__(self, page: Any, base_url: str, artifacts: Path, prefix: str = ""):
        self.page = page
        self.base_url = base_url.rstrip("/")
        self.artifacts = artifacts
        self.prefix = prefix
        self.console_errors: list[str] = []
        self.blocked_requests: list[str] = []
        self.screenshots: list[Path] = []
        self.nux_possible = True  # set by dagster_ui() from the server's shouldShowNux
        self.last_toast: str | None = None  # "Created backfill <id>" after launch_backfill

    # -- navigation ------------------------------------------------------------------------

    def goto(self, path: str) -> None:
        self.page.goto(self.base_url + path, wait_until="domcontentloaded")
        self._dismiss_nux()

    def _dismiss_nux(self) -> None:
        """Click "Skip" on the first-visit community dialog if it shows anyway
        (``dagster_ui`` calls the server's ``setNuxSeen`` first, which prevents it)."""
        if not self.nux_possible:
            return
        nux = self.page.get_by_role("dialog").filter(has_text="Join the Dagster community")
        try:
            nux.wait_for(state="visible", timeout=1500)
        except Exception:
            return
        nux.get_by_role("button", name="Skip").click()
        nux.wait_for(state="hidden")

    def open_lineage(self, group: str | None = None, location: str | None = None,
                     repository: str = "__repository__", expect: Sequence[str] = (),
                     timeout: float = 30.0) -> None:
        """The asset graph: of one asset group (``/locations/<repo>@<location>/asset-groups/
        <group>``, the group page's Lineage tab) or, without ``group``, the global lineage
        (``/asset-groups``). ``location`` defaults to the server's only code location.
        Waits until the nodes labelled ``expect`` (default: any node) are drawn and their
        live data has loaded."""
        if group is None:
            self.goto("/asset-groups")
        else:
            if location is None:
                location = self._only_location()
            repo_path = urllib.parse.quote(f"{repository}@{location}", safe="@")
            self.goto(f"/locations/{repo_path}/asset-groups/{urllib.parse.quote(group, safe='')}")
        deadline = time.monotonic() + timeout
        if expect:
            for label in expect:
                self.lineage_node(label).wait_for(state="visible", timeout=timeout * 1000)
        else:
            self.page.locator("foreignObject [data-tooltip]").first.wait_for(state="visible",
                                                                             timeout=timeout * 1000)
        # nodes render "Loading…" rows until their live data arrives
        nodes = self.page.locator("foreignObject > div")
        while time.monotonic() < deadline:
            if "Loading" not in " ".join(t or "" for t in nodes.all_inner_texts()):
                return
            time.sleep(0.25)

    def lineage_node(self, label: str, asset_key: str | Sequence[str] | None = None) -> Any:
        """Locator of one node of the lineage graph, by its label (the last component of
        its asset key). Pass ``asset_key`` to disambiguate equal labels of partitioned
        assets (matched through the node's partitions link)."""
        node = self.page.locator("foreignObject > div").filter(
            has=self.page.locator(f"[data-tooltip={json.dumps(label)}]"))
        if asset_key is not None:
            href = asset_url_path(asset_key) + "?"
            node = node.filter(has=self.page.locator(f"a[href^={json.dumps(href)}]"))
        return node.first

    def lineage_labels(self) -> list[str]:
        """Labels of the drawn asset nodes (each node's first ``data-tooltip``: its name)."""
        labels = self.page.locator("foreignObject > div").evaluate_all(
            "els => els.map(e => { const t = e.querySelector('[data-tooltip]'); return t ? t.dataset.tooltip : null; })")
        return [t.strip() for t in labels if t]

    def lineage_node_text(self, label: str, asset_key: str | Sequence[str] | None = None) -> str:
        """What a node shows, e.g. "state\\nLatest event\\n...\\nPartitions\\n38% filled\\n8 partitions"."""
        return self.lineage_node(label, asset_key).inner_text()

    def lineage_node_partitions(self, label: str, asset_key: str | Sequence[str] | None = None) -> dict[str, Any]:
        """``{"filled_percent": int|None, "partitions": int|None, "text": ...}`` of a partitioned node."""
        text = self.lineage_node_text(label, asset_key)
        filled = re.search(r"(\d+)% filled", text)
        count = re.search(r"(\d+) partitions?\b", text)
        return {"filled_percent": int(filled.group(1)) if filled else None,
                "partitions": int(count.group(1)) if count else None, "text": text}

    def open_asset(self, asset_key: str | Sequence[str], view: str | None = None) -> None:
        path = asset_url_path(asset_key) + (f"?view={view}" if view else "")
        self.goto(path)
        self.page.get_by_role("tab", name="Overview").or_(
            self.page.get_by_role("link", name="Overview")).first.wait_for(state="visible")

    def open_partitions_tab(self, asset_key: str | Sequence[str], timeout: float = 30.0) -> None:
        """The asset's Partitions tab (``/assets/<key>?view=partitions``), loaded: its status
        filter checkboxes ("Materialized (N)", "Missing (N)" ...) are shown."""
        self.open_asset(asset_key, view="partitions")
        self.page.get_by_text(re.compile(r"^Missing \(\d+\)$")).first.wait_for(state="visible",
                                                                              timeout=timeout * 1000)

    # -- reading the Partitions tab -------------------------------------------------------

    def partition_counts(self) -> dict[str, int]:
        """The Partitions tab's status counts: ``{"Failed": 0, "Materialized": 3,
        "Materializing": 0, "Missing": 5}`` (the labels of its filter checkboxes)."""
        counts = {}
        for label in ("Failed", "Materialized", "Materializing", "Missing"):
            loc = self.page.get_by_text(re.compile(rf"^{label} \(\d+\)$"))
            if loc.count():
                counts[label] = int(re.search(r"\((\d+)\)", loc.first.inner_text()).group(1))
        return counts

    def partitions_summary(self) -> str:
        """The "N Partitions Selected" line above the partition list."""
        return self.page.get_by_text(re.compile(r"^\d+ Partitions? Selected$")).first.inner_text()

    def wait_partition_counts(self, timeout: float = 60.0, reload_every: float = 10.0, **expected: int) -> dict[str, int]:
        """Wait until ``partition_counts()`` includes ``expected`` (e.g. ``Materialized=2``).
        The page polls live data itself; it is reloaded every ``reload_every`` s as a fallback."""
        deadline = time.monotonic() + timeout
        last_reload = time.monotonic()
        counts: dict[str, int] = {}
        while time.monotonic() < deadline:
            counts = self.partition_counts()
            if all(counts.get(k) == v for k, v in expected.items()):
                return counts
            if time.monotonic() - last_reload > reload_every:
                self.page.reload(wait_until="domcontentloaded")
                self.page.get_by_text(re.compile(r"^Missing \(\d+\)$")).first.wait_for(state="visible")
                last_reload = time.monotonic()
            time.sleep(0.5)
        raise AssertionError(f"partition counts {counts} never matched {expected} within {timeout:.0f}s")

    def select_partition(self, key: str, timeout: float = 30.0) -> dict[str, Any]:
        """Click a partition key in the Partitions tab's list (filtering by name first: the
        list is virtualized) and read its detail pane once loaded:
        ``{"status": "Materialized", "metadata": {label: shown text}, "text": pane text}``
        (``status`` is the badge next to the key: Materialized / Missing / Failed ...)."""
        page = self.page
        page.get_by_placeholder("Filter by name…").fill(key)
        page.locator(f"[title={json.dumps(key)}]").first.click()
        page.get_by_text("Latest materialization", exact=True).first.wait_for(state="visible")
        # the pane's header repeats the key (list row + header) and shows a "Loading…"
        # spinner (role=progressbar) until loaded; then read until two reads agree
        self._wait(lambda: page.locator(f"[data-tooltip={json.dumps(key)}]").count() >= 2, timeout,
                   lambda: f"partition {key}'s detail pane never showed")
        deadline = time.monotonic() + timeout
        last = None
        while True:
            if page.get_by_role("progressbar").count() == 0:
                current = self._read_partition_pane()
                if current == last:
                    return current
                last = current
            if time.monotonic() > deadline:
                raise AssertionError(f"partition {key}'s details still loading after {timeout:.0f}s")
            time.sleep(0.3)

    def _read_partition_pane(self) -> dict[str, Any]:
        page = self.page
        status = page.get_by_text(re.compile(r"^(Materialized|Missing|Failed|Materializing|In progress)$"))
        rows = page.locator("xpath=//*[normalize-space(text())='Metadata']/following-sibling::*//table//tr")
        metadata = {}
        for row in rows.all():
            cells = [c.strip() for c in row.locator("td").all_inner_texts()]
            if len(cells) >= 2 and cells[0]:
                metadata[cells[0]] = cells[1]
        pane = page.get_by_text("Latest materialization", exact=True).first.locator(
            "xpath=ancestor::*[.//table or .//*[normalize-space(text())='Metadata']][1]")
        return {"status": status.first.inner_text() if status.count() else None,
                "metadata": metadata,
                "text": pane.inner_text() if pane.count() else page.inner_text("body")}

    # -- the Materialize -> Launch backfill dialog ----------------------------------------

    def open_materialize_dialog(self, timeout: float = 30.0) -> Any:
        """Click the page's "Materialize…" / "Materialize all (N)…" button (asset page or
        lineage view), confirm the "Additional assets will be materialized" notice a
        non-subsettable multi_asset brings up, and return the launch dialog's locator."""
        button = self.page.get_by_role("button", name=re.compile(r"\bMaterialize( all \(\d+\))?…$"))
        button.first.click()
        launch = self.page.get_by_role("dialog").filter(has_text="Partition selection")
        notice = self.page.get_by_role("dialog").filter(has_text="Additional assets will be materialized")
        launch.or_(notice).first.wait_for(state="visible", timeout=timeout * 1000)
        if notice.count() and notice.first.is_visible():
            notice.get_by_role("button", name="Confirm").click()
        launch.first.wait_for(state="visible", timeout=timeout * 1000)
        return launch.first

    def dialog_selected_count(self, dialog: Any) -> int:
        """The "N partitions" count in the launch dialog's Partition selection header."""
        text = dialog.get_by_text(re.compile(r"^\d+ partitions?$")).first.inner_text()
        return int(text.split()[0])

    def select_dialog_partitions(self, dialog: Any, partition_keys: Sequence[str], timeout: float = 30.0) -> None:
        """In the launch dialog's Partition selection, select exactly ``partition_keys``.

        For dynamic partitions dagster 1.13 shows "All | Failed | Missing | Failed and
        missing | Custom" buttons (Custom active, 0 selected) and a multi-select ("Select a
        partition or create one") whose popover has a "Filter partitions" box, "Select all
        (N)" and a virtualized list of menu items with checkboxes. Don't click "Custom"
        when it is active: that selects every partition."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

        opener = dialog.locator('[aria-haspopup="dialog"]').first  # the multi-select
        filt = self.page.get_by_placeholder("Filter partitions")

        def opened() -> bool:
            # a click while the dialog is still settling can leave the popover shut: click again
            if not filt.is_visible():
                opener.click()
                try:
                    filt.wait_for(state="visible", timeout=5_000)
                except PlaywrightTimeoutError:
                    return False
            return True

        self._wait(opened, timeout, lambda: "the dialog's partition list did not open on a click")
        filt.fill("")
        select_all = self.page.get_by_role("menuitem").filter(has_text=re.compile(r"^Select all \(\d+\)"))
        # start from nothing selected: "Select all" toggles between all and none
        for _ in range(2):
            if self.dialog_selected_count(dialog) == 0:
                break
            select_all.first.click()
            self._wait(lambda: self.dialog_selected_count(dialog) in (0, self._all_count(select_all)), timeout)
        if self.dialog_selected_count(dialog) != 0:
            raise AssertionError("could not clear the dialog's partition selection")
        for key in partition_keys:
            filt.fill(key)
            item = self.page.get_by_role("menuitem").filter(has=self.page.locator(f"[title={json.dumps(key)}]"))
            item.first.wait_for(state="visible")
            box = item.first.locator("input[type=checkbox]")
            if box.count() and box.first.is_checked():
                continue
            item.first.click()
            if box.count():
                self._wait(lambda box=box: box.first.is_checked(), timeout)
        filt.fill("")
        # close the popover by clicking the dialog's title (Escape would close the dialog
        # too; clicking the "Partition selection" header collapses the section)
        dialog.get_by_text(re.compile(r"^Launch runs to materialize")).first.click()
        filt.wait_for(state="hidden")
        n = len(set(partition_keys))
        self._wait(lambda: self.dialog_selected_count(dialog) == n, timeout,
                   lambda: f"dialog shows {self.dialog_selected_count(dialog)} partitions selected, wanted {n}")

    @staticmethod
    def _all_count(select_all: Any) -> int:
        m = re.search(r"\((\d+)\)", select_all.first.inner_text())
        return int(m.group(1)) if m else -1

    @staticmethod
    def _wait(cond: Any, timeout: float, why: Any = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if cond():
                return
            if time.monotonic() > deadline:
                raise AssertionError(why() if why else f"condition not met within {timeout:.0f}s")
            time.sleep(0.1)

    def launch_backfill(self, asset_key: str | Sequence[str] | None, partition_keys: Sequence[str],
                        screenshot: str | None = "launch-dialog", timeout: float = 30.0) -> str:
        """Open the asset's page (unless ``asset_key`` is None: use the current page, e.g. a
        lineage view), open the Materialize dialog, select ``partition_keys`` (2 or more:
        with one partition the UI launches a plain run, not a backfill), click "Launch
        backfill" and return the backfill id the UI's mutation got back."""
        if len(partition_keys) < 2:
            raise ValueError("the UI launches a run, not a backfill, for a single partition")
        if asset_key is not None:
            self.open_asset(asset_key, view="partitions")
        dialog = self.open_materialize_dialog(timeout)
        self.select_dialog_partitions(dialog, partition_keys, timeout)
        if screenshot:
            self.screenshot(screenshot)
        button = dialog.get_by_role("button", name="Launch backfill")
        with self.page.expect_response(_is_launch_backfill_response, timeout=timeout * 1000) as resp_info:
            button.click()
        body = resp_info.value.json()
        result = (body.get("data") or {}).get("launchPartitionBackfill") or {}
        if result.get("__typename") != "LaunchBackfillSuccess" or "backfillId" not in result:
            raise AssertionError(f"the UI's launchPartitionBackfill failed: {json.dumps(body)[:3000]}")
        dialog.wait_for(state="hidden", timeout=timeout * 1000)
        backfill_id = result["backfillId"]
        # the UI confirms with a toast "Created backfill <id>  View" (fades after a few s)
        toast = self.page.get_by_text(re.compile(rf"Created backfill\s+{re.escape(backfill_id)}"))
        try:
            toast.first.wait_for(state="visible", timeout=5000)
            self.last_toast = toast.first.inner_text()
        except Exception:
            self.last_toast = None
        return backfill_id

    def open_backfill(self, backfill_id: str, timeout: float = 30.0) -> dict[str, Any]:
        """The backfill's page (``/runs/b/<id>``), loaded, as shown: ``{"status":
        "Succeeded" | "In progress" | "Failed" ..., "partitions": ["0004", "0003"],
        "assets": {"demo / state": {"completed": "100% completed", "targeted": 2,
        "in_progress": 0, "succeeded": 2, "failed": 0}}, "text": ...}``."""
        self.goto(f"/runs/b/{backfill_id}")
        page = self.page
        page.get_by_text(re.compile(r"% completed$")).first.wait_for(state="visible", timeout=timeout * 1000)

        def field(label: str) -> list[str]:  # the overview's "Label\nvalue..." blocks
            loc = page.get_by_text(label, exact=True).first.locator("xpath=..")
            return [t.strip() for t in loc.inner_text().split("\n")[1:] if t.strip()] if loc.count() else []

        self._wait(lambda: bool(field("Status")), timeout, lambda: "backfill page shows no Status")
        assets = {}
        rows = page.locator("xpath=//a[starts-with(@href, '/assets/')]/ancestor::div[count(div) >= 5][1]")
        for row in rows.all():
            link = row.locator("a[href^='/assets/']").first
            title = link.locator("[title]")
            name = title.first.get_attribute("title") if title.count() else link.inner_text().split("\n")[0]
            # the asset name is rendered twice (MiddleTruncate's measuring copy)
            cells = [t.strip() for t in row.inner_text().split("\n") if t.strip() and t.strip() != name]
            if len(cells) >= 5:
                completed, *nums = cells
                keys = ("targeted", "in_progress", "succeeded", "failed")
                assets[name] = {"completed": completed,
                                **{k: int(v) if v.isdigit() else v for k, v in zip(keys, nums[-4:], strict=False)}}
        return {"status": (field("Status") or [None])[0], "partitions": field("Partition selection"),
                "assets": assets, "text": page.inner_text("body")}

    # -- artifacts --------------------------------------------------------------------------

    def screenshot(self, name: str, full_page: bool = False) -> Path:
        self.artifacts.mkdir(parents=True, exist_ok=True)
        path = self.artifacts / f"{self.prefix}{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        self.screenshots.append(path)
        return path

    def save_html(self, name: str) -> Path:
        self.artifacts.mkdir(parents=True, exist_ok=True)
        path = self.artifacts / f"{self.prefix}{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.html"
        path.write_text(self.page.content())
        return path

    def graphql(self, query: str) -> dict[str, Any]:
        import requests

        body = requests.post(f"{self.base_url}/graphql", json={"query": query}, timeout=30).json()
        if body.get("errors") or body.get("data") is None:
            raise RuntimeError(f"GraphQL {query!r}: {json.dumps(body)[:2000]}")
        return body["data"]

    def _only_location(self) -> str:
        data = self.graphql("{ workspaceOrError { ... on Workspace { locationEntries { name } } } }")
        names = [e["name"] for e in data["workspaceOrError"]["locationEntries"]]
        if len(names) != 1:
            raise ValueError(f"several code locations {names}: pass location=")
        return names[0]


def _is_launch_backfill_response(response: Any) -> bool:
    if not response.url.split("?")[0].endswith("/graphql") or response.request.method != "POST":
        return False
    try:
        return "launchPartitionBackfill" in (response.request.post_data or "")
    except Exception:
        return False


@contextmanager
def dagster_ui(base_url: str, *, artifacts: str | Path = ARTIFACTS, artifacts_prefix: str = "",
               viewport: tuple[int, int] = (1440, 900), default_timeout_ms: int = 30_000,
               block_external: bool = True, screenshot_on_error: bool = True,
               dismiss_nux: bool = True) -> Iterator[DagsterUI]:
    """A fresh headless Chromium (new user data dir, removed on exit) on ``base_url``.

    With ``dismiss_nux`` the server's first-visit community dialog is marked seen
    (GraphQL ``setNuxSeen``) before any page loads, so screenshots don't show it.

    Requests to hosts other than the webserver's are aborted (``block_external``): the
    UI works offline and nothing waits on the network. On an exception inside the
    block, a screenshot and the page's HTML are saved as ``<prefix>failure.*`` and the
    browser console errors are appended to the exception's notes."""
    from playwright.sync_api import sync_playwright

    problem = browser_available()
    if problem:
        raise RuntimeError(problem)
    own_host = urllib.parse.urlsplit(base_url).netloc
    user_data = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                user_data, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": viewport[0], "height": viewport[1]}, timezone_id="UTC", locale="en-US")
            try:
                context.set_default_timeout(default_timeout_ms)
                page = context.pages[0] if context.pages else context.new_page()
                ui = DagsterUI(page, base_url, Path(artifacts), artifacts_prefix)
                ui.nux_possible = False  # with dismiss_nux=False the dialog is left alone
                if dismiss_nux and ui.graphql("{ shouldShowNux }")["shouldShowNux"]:
                    ui.graphql("mutation { setNuxSeen }")  # the first-visit community dialog
                    # if the server could not record it, click "Skip" after each navigation
                    ui.nux_possible = ui.graphql("{ shouldShowNux }")["shouldShowNux"]
                if block_external:
                    def route(r: Any) -> None:
                        if urllib.parse.urlsplit(r.request.url).netloc in (own_host, ""):
                            r.continue_()
                        else:
                            ui.blocked_requests.append(r.request.url)
                            r.abort()
                    context.route("**/*", route)
                page.on("console", lambda m: ui.console_errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: ui.console_errors.append(f"pageerror: {e}"))
                try:
                    yield ui
                except BaseException as exc:
                    if screenshot_on_error and not page.is_closed():
                        try:
                            ui.screenshot("failure")
                            ui.save_html("failure")
                        except Exception:
                            pass
                    if ui.console_errors and hasattr(exc, "add_note"):
                        exc.add_note("browser console errors:\n" + "\n".join(ui.console_errors[-20:]))
                    raise
            finally:
                context.close()
    finally:
        shutil.rmtree(user_data, ignore_errors=True)
