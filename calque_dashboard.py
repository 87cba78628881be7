"""calque dashboard: a read-only live web page over a calque store (pools, runs, workers), and
the run page as one self-contained HTML file (`calque runs report RUN --html FILE`).

    calque dashboard                                  # http://127.0.0.1:8265/
    calque dashboard --host 0.0.0.0 --token SECRET    # another host: the token on every request

It reads the store only through calque.py's functions and caches each run's summaries as it reads
them: a refresh lists only the summaries past those it has and reads only the new ones, as submit's
waiting does. Aggregates are made here, so a page carries charts, never claim lists. Pages are HTML
and hand-written SVG, every store string escaped; the page's one script polls its own URL for its
new main part. The JSON API (/api/...) is in docs/dashboard.md.
"""
import contextlib
import datetime
import glob
import hmac
import html
import http.cookies
import http.server
import ipaddress
import json
import math
import os
import re
import secrets
import socket
import sys
import threading
import time
import traceback
import urllib.parse

import calque_core
import calque_runs
import calque_cost
import calque_supervisor
import calque_fleet

REFRESH_MS = 2000          # ms between two polls of a live page
POOL_TTL = 2.0             # s a pool's status (depths, worker stats, supervisor) is reused for
RUNS_PER_PAGE = 20         # runs on one page of the runs list
POOL_RUNS = 5              # a pool's recent runs that its timeline and cost table show
RECENT = 30.0              # s of finished claims that "items/s now" and a live run's ETA use
ENTER_WINDOW = 600.0       # s: a worker's @enter that ended this long before a run is still drawn
RATE_BUCKETS = 60          # bars of the items/s chart
TIMELINE_WIDTH = 900       # px of a timeline's time axis
MIN_BAR = 4                # px: claims narrower, less than a pixel apart, merge into one bar
ROWS_SHOWN = 40            # worker rows of one timeline (those that started last)
ERROR_GROUPS = 10          # groups of item errors a run page lists
LOG_LINES = 12             # lines of each worker log's tail
LOG_BYTES = 8192           # bytes read from the end of a worker log for its tail
TOKEN = re.compile(r"[A-Za-z0-9._~-]{8,}")   # a --token: it travels in a URL and a cookie
COLOURS = {"enter": "#f59e0b", "claim": "#2563eb", "partial": "#f97316", "failed": "#dc2626",
           "dead": "#7f1d1d", "startup": "#a8a29e"}
KIND_NAMES = {"enter": "@enter", "claim": "claim", "partial": "claim with failed items",
              "failed": "claim failed", "dead": "dead-lettered", "startup": "start-up (cold)"}
LADDER_LINES = {"warm": "#2563eb", "cold": "#78716c", "serverless": "#9333ea"}
OUTCOMES = {"ok": "#16a34a", "failed": "#dc2626", "dead_lettered": "#7f1d1d",
            "cancelled": "#a8a29e"}
STATE_COLOURS = dict(zip(calque_runs.RUN_STATES, (COLOURS["claim"], OUTCOMES["ok"], COLOURS["partial"],
                                             OUTCOMES["failed"], OUTCOMES["cancelled"],
                                             OUTCOMES["dead_lettered"], COLOURS["enter"])))
esc = html.escape


def epoch(text):
    return datetime.datetime.fromisoformat(text).timestamp()


# ------------------------------------------------------------------------------------------------
# the data: runs cached as read, pool status reused for POOL_TTL; each view is the API's JSON answer
class RunCache:
    """One run's record and the summaries read so far. A refresh of an unfinished run reads its
    record (a cancel, how far sending got) and lists the summaries past the last claim below which
    all are read, reading only the new ones; a staged run whose every claim has a summary is not
    read again. A summary once read is kept: a redriven claim's new one shows after a restart."""

    def __init__(self, run):
        self.run, self.summaries, self.times, self.below, self.order = run, {}, {}, 0, []
        self.cost = (0, None)   # (summaries priced, run_cost_report's answer: None before one)
        self.names = {}    # {index: name} of the failed items shown (calque.item_names)

    @property
    def complete(self):
        return self.run["staged"] and len(self.summaries) == len(self.run["claims"])

    def refresh(self, backend, reread=True):
        if self.complete:
            return
        run_id = self.run["run_id"]
        self.run = calque_core.read_run(backend, run_id) if reread else self.run
        if len(self.order) != len(self.run["claims"]):   # claims are listed as a stream is cut
            self.order = sorted(self.run["claims"], key=lambda c: calque_core.summary_key(run_id, c))
        while self.below < len(self.order) and self.order[self.below] in self.summaries:
            self.below += 1
        after = self.order[self.below - 1] if self.below else None
        new = [k for k in calque_core.list_summaries(backend, run_id, after)
               if k.rsplit("/", 1)[1][:-5] not in self.summaries]
        for s in calque_core.read_summaries(backend, run_id, new):
            self.summaries[s["claim"]] = s
            self.times[s["claim"]] = (epoch(s["started_at"]), epoch(s["finished_at"]))

    def in_order(self):
        return [self.summaries[c] for c in self.run["claims"] if c in self.summaries]


class Dashboard:
    """What the pages show, read through calque.py under one lock (one refresh at a time)."""

    def __init__(self, conf, backend, price):
        self.conf, self.backend, self.price = conf, backend, price
        self.lock = threading.RLock()
        self.runs, self.records, self.pools = {}, {}, {}
        self.fresh = None   # during a request: what it has read already ("runs/", run ids)

    @contextlib.contextmanager
    def request(self):
        """One page or API answer, under the lock: each run and the runs list read at most once."""
        with self.lock:
            self.fresh = set()
            try:
                yield
            finally:
                self.fresh = None

    def once(self, what):
        """True the first time `what` is asked for in this request (always, outside one)."""
        seen = set() if self.fresh is None else self.fresh
        first = what not in seen
        seen.add(what)
        return first

    # -- reading
    def run_cache(self, run_id):
        cache, new = self.runs.get(run_id), run_id not in self.runs
        if new:
            cache = self.runs[run_id] = RunCache(calque_core.read_run(self.backend, run_id))
        if self.once(run_id):
            cache.refresh(self.backend, reread=not new)
        self.records[run_id] = cache.run
        return cache

    def run_records(self):
        """Every run record, newest first: one LIST of runs/, a GET for each run not seen before."""
        for folder in self.backend.store.list("runs/") if self.once("runs/") else ():
            run_id = folder.rsplit("/", 1)[1]
            if run_id not in self.records and calque_core.SAFE_ID.match(run_id):
                with contextlib.suppress(calque_core.UserError):   # no record yet: still being staged
                    self.records[run_id] = calque_core.read_run(self.backend, run_id)
        return sorted(self.records.values(), key=lambda r: r["created_at"], reverse=True)

    def outcome(self, cache):
        """calque.run_view of a cached run, its state too; no dead-letter scan (Safe by default)."""
        return calque_runs.run_view(self.backend, cache.run, cache.in_order(), dead_letters=False)

    def pool_status(self, model):
        """calque.pool_status, read again after POOL_TTL s (a missing pool's UserError too)."""
        at, status = self.pools.get(model, (-math.inf, None))
        if time.monotonic() - at > POOL_TTL:
            try:
                status = calque_fleet.pool_status(self.conf, self.backend, model)
            except calque_core.UserError as err:
                status = err
            self.pools[model] = (time.monotonic(), status)
        if isinstance(status, calque_core.UserError):
            raise status
        return status

    def pool_stats(self, model):
        """The stats of the pool's workers (not its cold runs'); none once the pool is deleted."""
        with contextlib.suppress(calque_core.UserError):
            return [w for w in self.pool_status(model)["workers"] if w.get("mode") != "cold"]
        return []

    def model_runs(self, model, mode, count):
        """The model's `count` most recent runs of `mode`, refreshed, oldest first."""
        runs = [r for r in self.run_records() if r["model"] == model and r["mode"] == mode][:count]
        return [self.run_cache(r["run_id"]) for r in reversed(runs)]

    def run_cost(self, cache):
        """run_cost_report's (report, ladder, label, status), priced again only on new summaries."""
        if cache.cost[0] != len(cache.summaries):
            report = calque_cost.run_cost_report(self.backend, cache.run, cache.in_order(), self.price)
            cache.cost = (len(cache.summaries), report)
        return cache.cost[1]

    # -- views: each a dict of plain values, what /api/... answers
    def pools_view(self):
        return {"pools": [self.pool_summary(m) for m in calque_supervisor.list_pools(self.backend)]}

    def pool_summary(self, model):
        status = self.pool_status(model)
        caches = self.model_runs(model, "pool", POOL_RUNS)
        workers = status["workers"]
        claims = sum(w.get("claims", 0) for w in workers)
        return {"model": model, "queue": status["queue"], "dlq": status["dlq"],
                "ec2": bool(status["ec2"]), "local_workers": len(status["local_workers"]),
                "workers_running": sum(w.get("state") == "running" for w in workers),
                "warm_hit_rate": sum(w.get("warm_hits", 0) for w in workers) / claims
                if claims else None,
                "items_per_second_now": items_now(caches)}

    def pool_view(self, model):
        view = self.pool_summary(model)
        caches = self.model_runs(model, "pool", POOL_RUNS)
        stats = self.pool_stats(model)
        view["workers"] = pool_workers(self.pool_status(model), latest_summaries(caches))
        view["timeline"] = timeline(caches, stats, live=bool(view["workers_running"]))
        view["runs"] = [self.cost_row(c) for c in caches + self.model_runs(model, "cold", 1)]
        cost, view["priced_as"] = calque_cost.pool_cost_report(stats, self.price)
        view["pool_cost"] = cost if stats else None
        return view

    def cost_row(self, cache):
        """A run's line of a pool's cost table: what it cost, and its cold counterfactual."""
        cost, pool = self.run_cost(cache), cache.run["mode"] == "pool"
        return {"run_id": cache.run["run_id"], "mode": cache.run["mode"],
                "claims": len(cache.run["claims"]), "done": len(cache.summaries),
                "state": self.outcome(cache)["state"],
                "cost_usd": cost[0]["total_usd"] if cost else None,
                "cold_usd": cost[0]["cold"]["usd"] if cost and pool else None}

    def runs_view(self, page=1):
        records = self.run_records()
        pages = max(1, math.ceil(len(records) / RUNS_PER_PAGE))
        page = min(max(1, page), pages)
        shown = [self.run_cache(r["run_id"]) for r in
                 records[(page - 1) * RUNS_PER_PAGE:page * RUNS_PER_PAGE]]
        return {"page": page, "pages": pages, "total": len(records), "runs": [
            {"run_id": c.run["run_id"], "model": c.run["model"], "mode": c.run["mode"],
             "items": c.run["items"], "claims": len(c.run["claims"]),
             "done_claims": len(c.summaries), "created_at": c.run["created_at"],
             "cancelled": bool(c.run.get("cancelled")), "state": view["state"],
             "ok": view["items"]["ok"], "failed": view["items"]["failed"],
             "outcomes": view["items"]} for c, view in ((c, self.outcome(c)) for c in shown)]}

    def run_view(self, run_id):
        cache = self.run_cache(run_id)
        run, summaries, now = cache.run, cache.in_order(), time.time()
        view = self.outcome(cache)
        items = view["items"]
        groups = calque_runs.item_errors(summaries)
        shown = [i for i in calque_runs.first_items(groups, ERROR_GROUPS) if i not in cache.names]
        cache.names.update(calque_runs.item_names(self.backend, run, summaries, shown))
        rate = overall_rate(cache) if cache.complete else items_now([cache], now)
        stats = self.pool_stats(run["model"]) if run["mode"] == "pool" else []
        return {
            "run_id": run_id, "model": run["model"], "mode": run["mode"],
            "created_at": run["created_at"], "items_total": run["items"],
            "claims_total": len(run["claims"]), "complete": view["complete"],
            "state": view["state"], "cancelled": run.get("cancelled"), "items": items,
            "claim_counts": view["claim_counts"],
            "queue": view["queue"], "items_per_second": rate,
            "eta_seconds": items["pending"] / rate if rate and items["pending"] else None,
            "items_running_done": view["items_running_done"],   # inside claims not finished yet
            "done_fraction": 1 - (items["pending"] - view["items_running_done"]) / run["items"]
            if run["items"] else 1.0,
            "rate_series": rate_series(cache, now),
            "timeline": timeline([cache], stats, live=bool(items["pending"])),
            "failures": failures(groups, view, cache.names),
            "cost": cost_view(self.run_cost(cache)),
            "logs": worker_logs(self.conf, run, self.backend)}


def cost_view(cost):
    """A run's cost so far against its cold counterfactual and serverless; the crossover ladder."""
    if not cost:
        return None
    report, ladder, label, _ = cost
    serverless = ladder and ladder["options"]["serverless"]
    return {"priced_as": label, "so_far_usd": report["total_usd"],
            "cold_usd": report["cold"]["usd"],
            "warm_usd": report["warm_usd"], "saving_usd": report["saving_usd"],
            "items": report["items"], "partial": report["partial"], "ladder": ladder,
            "serverless_usd": serverless and serverless["fixed_usd"]
            + serverless["usd_per_item"] * report["items"]}


def items_now(caches, now=None):
    """Items a second over the last RECENT s (or since the first claim began, if later), from the
    claims that finished in them; None when none did."""
    now = time.time() if now is None else now
    starts = [t[0] for c in caches for t in c.times.values()]
    window = min(RECENT, now - min(starts, default=now))
    done = sum(c.summaries[claim]["items"] for c in caches for claim, (_, end) in c.times.items()
               if end >= now - window)
    return done / window if done and window > 0 else None


def overall_rate(cache):
    """Items a second of a complete run, from its first claim's start to its last one's end."""
    start = min((t[0] for t in cache.times.values()), default=0.0)
    end = max((t[1] for t in cache.times.values()), default=0.0)
    items = sum(s["items"] for s in cache.summaries.values())
    return items / (end - start) if end > start else None


def rate_series(cache, now):
    """Items/s in RATE_BUCKETS buckets from the first claim's start, each claim's items spread
    evenly over its span."""
    if not cache.times:
        return {"bucket_seconds": 0, "values": []}
    t0 = min(t[0] for t in cache.times.values())
    t1 = max(max(t[1] for t in cache.times.values()), 0 if cache.complete else now)
    width = max(t1 - t0, 1e-3) / RATE_BUCKETS
    buckets = [0.0] * RATE_BUCKETS
    for claim, (start, end) in cache.times.items():
        n, span = cache.summaries[claim]["items"], end - start
        first, last = int((start - t0) / width), min(int((end - t0) / width), RATE_BUCKETS - 1)
        for b in range(first, last + 1):
            overlap = min(end, t0 + (b + 1) * width) - max(start, t0 + b * width)
            buckets[b] += n * overlap / span if span > 0 else n
    return {"bucket_seconds": width, "values": [round(b / width, 3) for b in buckets]}


def latest_summaries(caches):
    """{worker id: its most recent summary} over the cached runs."""
    ended = sorted(((c.times[claim][1], s) for c in caches for claim, s in c.summaries.items()),
                   key=lambda pair: pair[0])
    return {s["worker_id"]: s for _, s in ended}   # each worker's latest written last


def pool_workers(status, latest):
    """The running workers and the last few stopped (from their stats), each joined by pid with
    its local supervisor slot (warm, GPUs, restarts, last exit) and with its last claim's GPU
    utilisation; a local slot still loading (no stats yet) too."""
    host = socket.gethostname()
    slots = {w["pid"]: w for w in status["local_workers"] if w["pid"]}
    stats = status["workers"]
    running = [w for w in stats if w.get("state") in calque_supervisor.LIVE_STATES]
    stopped = sorted((w for w in stats if w.get("state") not in calque_supervisor.LIVE_STATES),
                     key=lambda w: w["updated_at"])
    shown = running + stopped[-calque_supervisor.STOPPED_SHOWN:]
    joined = {w.get("pid") for w in shown if w.get("host") == host}
    shown += [{"worker_id": f"slot {s['slot']} (pid {s['pid']})", "state": "loading",
               "pid": s["pid"], "host": host, "claims": 0, "warm_hits": 0, "items": 0}
              for s in status["local_workers"] if s["alive"] and s["pid"] not in joined]
    rows = []
    for w in shown:
        slot = slots.get(w.get("pid")) if w.get("host") == host else None
        gpu = (latest.get(w["worker_id"]) or {}).get("gpu_utilisation") or {}
        warm = slot["warm"] if slot else w["state"] == "running" and w["enter_count"] > 0
        rows.append({"worker_id": w["worker_id"], "state": w["state"], "lost": w.get("lost"),
                     "warm": warm,
                     "gpus": slot and slot.get("gpus"), "gpu_utilisation": gpu.get("value"),
                     "gpu_note": gpu.get("reason"), "restarts": slot and slot["restarts"],
                     "last_exit": (slot or {}).get("last_exit") or w.get("exit"),
                     "claims": w["claims"], "warm_hits": w["warm_hits"], "items": w["items"]})
    return rows


def enter_span(stats):
    """(start, end) epoch s of a worker's @enter, from its stats; None before it is done."""
    if not stats.get("enter_count"):
        return None
    if stats.get("entered_at"):
        end = epoch(stats["entered_at"])
    else:   # stats of a worker older than entered_at: it loaded right after its start-up
        end = (epoch(stats["started_at"]) + stats.get("acquisition_seconds", 0)
               + stats["enter_seconds"])
    return end - stats["enter_seconds"], end


def claim_segments(cache):
    """{worker id: [(start, end, kind, title)]} of a run's claims; a cold claim's start-up (before
    it) and its @enter (inside it) are segments of their own."""
    segments = {}
    for claim, s in cache.summaries.items():
        if s["status"] == "cancelled":
            continue
        start, end = cache.times[claim]
        kind = "dead" if s.get("error") else {"ok": "claim", "partial": "partial"}.get(s["status"],
                                                                                       "failed")
        title = (f"{cache.run['run_id']} {claim}: {s['items']} items, {s['claim_seconds']:.2f} s"
                 + (f", {len(s['failed'])} failed" if s["failed"] else "")
                 + (", warm" if s["warm_hit"] else ""))
        row = segments.setdefault(s["worker_id"], [])
        paid = s.get("enter_seconds_paid", 0)
        if paid:
            row.append((start - s.get("acquisition_seconds", 0), start, "startup", "start-up"))
            row.append((start, start + paid, "enter", f"@enter {paid:.2f} s (in the claim)"))
            start = min(start + paid, end)
        row.append((start, end, kind, title))
    return segments


def timeline(caches, stats, live):
    """One row per worker of the runs' claims: bars [start s, end s, kind, claims, title] from the
    window's start, claims less than a pixel apart and narrower than MIN_BAR px merged into one bar
    (title None). A pool worker's @enter comes from its stats when it ended within ENTER_WINDOW s of
    the first claim. A live window ends now: a worker's idle tail shows."""
    segments = {}
    for cache in caches:
        for worker, row in claim_segments(cache).items():
            segments.setdefault(worker, []).extend(row)
    if not segments:
        return {"start": None, "seconds": 0, "rows": [], "rows_hidden": 0}
    first = min(seg[0] for row in segments.values() for seg in row)
    for w in stats:
        span = enter_span(w)
        if span and w["worker_id"] in segments and span[1] >= first - ENTER_WINDOW:
            segments[w["worker_id"]].append((*span, "enter", f"@enter {w['enter_seconds']:.2f} s"))
    t0 = min(seg[0] for row in segments.values() for seg in row)
    t1 = max(seg[1] for row in segments.values() for seg in row)
    span = max(max(t1, time.time()) if live else t1, t0 + 1e-3) - t0
    pixel, rows = span / TIMELINE_WIDTH, []
    for worker, row in sorted(segments.items(), key=lambda kv: min(s[0] for s in kv[1])):
        bars = []
        for start, end, kind, title in sorted(row):
            last = bars[-1] if bars else None
            if (last and last[2] == kind and start - t0 - last[1] < pixel
                    and min(end - start, last[1] - last[0]) < MIN_BAR * pixel):
                last[1], last[3], last[4] = max(last[1], end - t0), last[3] + 1, None
            else:
                bars.append([start - t0, end - t0, kind, 1, title])
        rows.append({"worker_id": worker, "claims": sum(b[3] for b in bars if b[2] not in (
            "enter", "startup")), "enters": sum(b[3] for b in bars if b[2] == "enter"),
            "bars": [[round(b[0], 3), round(b[1], 3), *b[2:]] for b in bars]})
    hidden = max(0, len(rows) - ROWS_SHOWN)
    return {"start": calque_core.now_iso(t0), "seconds": span, "rows": rows[hidden:],
            "rows_hidden": hidden}


def failures(groups, view, names):
    """Failed items by error (calque.item_errors' groups: message, count, first items by `names`,
    else index); dead-lettered claims."""
    dead = {}
    for claim, v in view["claims"].items():
        if v["state"] == "dead-lettered":
            dead.setdefault(v["detail"], []).append(claim)
    return {"failed_items": view["items"]["failed"],
            "groups": [{"message": message, "count": len(indices),
                        "first_items": [names.get(i, i) for i in
                                        sorted(indices)[:calque_core.FIRST_ITEMS_SHOWN]]}
                       for message, indices in groups[:ERROR_GROUPS]],
            "groups_hidden": max(0, len(groups) - ERROR_GROUPS),
            "dead_lettered": [{"reason": reason, "claims": calque_runs.claim_list(claims)}
                              for reason, claims in dead.items()]}


def worker_logs(conf, run, backend):
    """{log path: its last LOG_LINES lines} of the run's workers on this machine (a local pool's
    slots, a cold run's shards); for an EC2 pool, {"": where its logs are}."""
    folder = (os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "runs", run["run_id"])
              if run["mode"] == "cold" else calque_core.state_dir(conf, run["model"]))
    tails = {}
    for path in sorted(glob.glob(os.path.join(folder, "worker-*.log"))):
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_BYTES))
            tails[path] = f.read().decode(errors="replace").splitlines()[-LOG_LINES:]
    if not tails and backend.kind == "aws" and run["mode"] == "pool":
        tails[""] = ["no worker log on this machine: an EC2 worker's log is its journal "
                     "(`journalctl -u calque-warmd` on the instance)"]
    return tails


# ------------------------------------------------------------------------------------------------
# the pages: HTML and SVG made of the views, every value that comes from the store through esc()
CSS = """
:root{--ink:#1c1917;--mute:#78716c;--line:#e7e5e4}*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,sans-serif;color:var(--ink);background:#f5f5f4}
header{background:#1c1917;color:#fafaf9;padding:10px 24px;display:flex;gap:18px;
align-items:baseline}header a{color:#fafaf9;text-decoration:none;font-weight:600}
header .where{color:#a8a29e;font-size:12px}
#live{margin-left:auto;font-size:12px;color:#a8a29e}main{padding:16px 24px;max-width:1280px}
h1{font-size:20px;margin:4px 0 12px}h2{font-size:15px;margin:0 0 8px}
section{background:#fff;border:1px solid var(--line);border-radius:8px;padding:14px 16px;
margin:0 0 14px;overflow-x:auto}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(440px,1fr));gap:0 14px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;white-space:nowrap;
border-bottom:1px solid var(--line)}th{color:var(--mute);font-weight:500;font-size:12px}
.n{text-align:right;font-variant-numeric:tabular-nums}.mute{color:var(--mute)}
.msg{white-space:pre-wrap;word-break:break-word}a{color:#1d4ed8}
.bar{display:flex;height:18px;border-radius:4px;overflow:hidden;background:var(--line);margin:6px 0}
.bar span{display:block}.thin{height:7px;margin:2px 0;background:none}.track{background:var(--line)}
.figs{display:flex;gap:24px;flex-wrap:wrap;margin:6px 0 12px}.figs b{font-size:18px;display:block}
.key{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px}
pre{background:#1c1917;color:#e7e5e4;padding:8px 10px;border-radius:6px;overflow-x:auto;
font-size:12px;margin:4px 0 10px}.pill{padding:1px 7px;border-radius:9px;font-size:12px;
background:var(--line)}.ok{background:#dcfce7}.bad{background:#fee2e2}
svg text{font:11px system-ui,sans-serif;fill:#57534e}
"""
SCRIPT = """(() => {
  const live = document.getElementById("live");
  let main = document.getElementById("main"), last = null, busy = false;
  async function poll() {
    if (busy || document.hidden || main.dataset.live !== "1") return;
    busy = true;
    const url = new URL(location.href);
    url.searchParams.set("part", "main");
    try {
      const answer = await fetch(url, {cache: "no-store", credentials: "same-origin"});
      if (!answer.ok) { live.textContent = "update failed: HTTP " + answer.status; return; }
      const text = await answer.text();
      if (text !== last) {
        const box = document.createElement("div");
        box.innerHTML = text;
        const fresh = box.firstElementChild;
        fresh.dataset.updates = String(Number(main.dataset.updates || 0) + 1);
        main.replaceWith(fresh);
        main = fresh;
        last = text;
      }
      live.textContent = "live, updated " + new Date().toLocaleTimeString();
    } catch (err) { live.textContent = "dashboard unreachable; retrying"; }
    finally { busy = false; }
  }
  live.textContent = main.dataset.live === "1" ? "live" : "";
  setInterval(poll, %d);
})();"""


def usd(x):
    """Dollars to 3 significant figures ($0.0000634, $1.25, $1,234), as a table has room for."""
    if x is None:
        return "-"
    if abs(x) >= 100 or x == 0:
        return calque_cost._usd(x)
    return f"${x:.{max(2, 2 - math.floor(math.log10(abs(x))))}f}".replace("$-", "-$")


def secs(s):   # _duration, but below 2 min whole seconds (0.01 s below 10 s)
    return calque_fleet._duration(s) if s >= 120 else f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def percent(x):
    return "-" if x is None else f"{x:.0%}"


def rate_text(x):
    return "-" if x is None else f"{x:,.1f}"


def depth(q):
    return "?" if q is None else f"{q['visible']} visible, {q['in_flight']} in flight"


def link(kind, name):
    return f'<a href="/{kind}/{urllib.parse.quote(name, safe="")}">{esc(name)}</a>'


def fig(value, what):
    return f"<div><b>{value}</b><span class=mute>{what}</span></div>"


def document(title, main, where, script=True):
    """A whole page: served, with the polling script (allowed by its nonce in the CSP); a report
    file, with no script at all."""
    nonce = secrets.token_urlsafe(12)
    csp = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; " + (
        f"script-src 'nonce-{nonce}'; connect-src 'self'" if script else "script-src 'none'")
    js = f'<script nonce="{nonce}">{SCRIPT % REFRESH_MS}</script>' if script else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<link rel="icon" href="data:,">'
            f'<title>{esc(title)}</title><style>{CSS}</style></head><body><header>'
            f'<a href="/">calque</a><span class="where">{esc(where)}</span><span id="live"></span>'
            f'</header>{main}{js}</body></html>')


def main_part(body, live):
    return f'<main id="main" data-live="{1 if live else 0}">{body}</main>'


def pools_table(pools):
    if not pools:
        return '<p class="mute">no pools in this store</p>'
    rows = "".join(
        f"<tr><td>{link('pools', p['model'])}{' <span class=pill>EC2</span>' * p['ec2']}</td>"
        f"<td>{depth(p['queue'])}</td><td class=n>{p['dlq']['visible'] if p['dlq'] else '?'}</td>"
        f"<td class=n>{p['workers_running']}</td><td class=n>{percent(p['warm_hit_rate'])}</td>"
        f"<td class=n>{rate_text(p['items_per_second_now'])}</td></tr>" for p in pools)
    return ("<table><tr><th>pool</th><th>queue</th><th class=n>dead-letter</th>"
            "<th class=n>workers running</th><th class=n>warm hits</th><th class=n>items/s now</th>"
            f"</tr>{rows}</table>")


def state_pill(state):
    """A run's state (calque.run_state) in its colour."""
    return (f"<span class=pill data-state='{esc(state)}' style='background:{STATE_COLOURS[state]};"
            f"color:#fff'>{esc(state)}</span>")


def runs_table(view, base):
    if not view["runs"]:
        return '<p class="mute">no runs yet</p>'
    rows = []
    for r in view["runs"]:
        total = max(r["items"], 1)
        bar = "".join(f"<span style='width:{r['outcomes'][k] / total:.1%};background:{c}'></span>"
                      for k, c in OUTCOMES.items() if r["outcomes"][k])
        rows.append(f"<tr><td>{link('runs', r['run_id'])}</td><td>{esc(r['model'])}</td>"
                    f"<td>{esc(r['mode'])}</td><td class=n>{r['items']:,}</td>"
                    f"<td style='width:160px'><div class='bar thin track'>{bar}</div></td>"
                    f"<td class=n>{r['ok']:,}</td><td class=n>{r['failed']:,}</td>"
                    f"<td>{state_pill(r['state'])}</td>"
                    f"<td class=mute>{esc(r['created_at'])}</td></tr>")
    pager = " ".join(f'<a href="{base}?page={p}">{p}</a>' if p != view["page"] else f"<b>{p}</b>"
                     for p in range(1, view["pages"] + 1)) if view["pages"] > 1 else ""
    return ("<table><tr><th>run</th><th>model</th><th>mode</th><th class=n>items</th>"
            "<th>items by outcome</th><th class=n>ok</th><th class=n>failed</th><th>state</th>"
            "<th>created</th></tr>"
            f"{''.join(rows)}</table><p class=mute>{view['total']} run(s), newest first. "
            f"{pager}</p>")


def svg_timeline(tl):
    """Each worker's claims as bars on one time axis, its claim count beside its name; the grey
    track shows through where the worker idled."""
    if not tl["rows"]:
        return '<p class="mute">no claim has finished yet</p>'
    label, row_h, width = 200, 22, TIMELINE_WIDTH
    height, scale = len(tl["rows"]) * row_h + 24, width / tl["seconds"]
    parts = [f'<svg id="timeline" width="{label + width + 20}" height="{height}" '
             f'viewBox="0 0 {label + width + 20} {height}" role="img">']
    for i, row in enumerate(tl["rows"]):
        y = i * row_h
        parts.append(f'<g class="worker" data-worker="{esc(row["worker_id"])}" '
                     f'data-claims="{row["claims"]}" data-enters="{row["enters"]}">'
                     f'<text x="0" y="{y + 15}">{esc(row["worker_id"][-24:])}</text>'
                     f'<text x="{label - 8}" y="{y + 15}" text-anchor="end">{row["claims"]}</text>'
                     f'<rect x="{label}" y="{y + 3}" width="{width}" height="{row_h - 6}" '
                     f'fill="#f5f5f4"/>')
        for start, end, kind, count, title in row["bars"]:
            x, w = label + start * scale, max((end - start) * scale, 1.0)
            w = w - 1 if w >= MIN_BAR and count == 1 else w   # a pixel between two claims
            tip = title or f"{count} claims, {end - start:.2f} s"
            parts.append(f'<rect class="{kind}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" '
                         f'height="{row_h - 6}" fill="{COLOURS[kind]}"><title>{esc(tip)}</title>'
                         '</rect>')
        parts.append("</g>")
    axis = len(tl["rows"]) * row_h + 14
    parts += [f'<text x="{label + width * k / 5:.0f}" y="{axis}" text-anchor="middle">'
              f'+{secs(tl["seconds"] * k / 5)}</text>' for k in range(6)]
    kinds = {b[2] for row in tl["rows"] for b in row["bars"]}
    legend = "".join(f'<span class="key" style="background:{COLOURS[k]}"></span>{KIND_NAMES[k]}'
                     for k in COLOURS if k in kinds)
    hidden = tl["rows_hidden"]
    more = f"; {hidden} workers that started earlier not shown" if hidden else ""
    return (f'<div style="overflow-x:auto">{"".join(parts)}</svg></div><p class="mute">from '
            f'{esc(tl["start"])}{more}: {legend}<span class="key" style="background:#f5f5f4;'
            f'border:1px solid #d6d3d1"></span>idle; the number is the worker\'s claims</p>')


def svg_rate(series):
    values = series["values"]
    if not values:
        return '<p class="mute">no claim has finished yet</p>'
    w, h, top = 440, 120, max(values) or 1
    step = w / len(values)
    bars = "".join(f'<rect x="{i * step:.1f}" y="{h - v / top * h:.1f}" '
                   f'width="{max(step - 1, 1):.1f}" height="{v / top * h:.1f}" fill="#93c5fd"/>'
                   for i, v in enumerate(values) if v)
    return (f'<svg width="{w + 80}" height="{h + 20}" viewBox="0 0 {w + 80} {h + 20}">{bars}'
            f'<line x1="0" y1="{h}" x2="{w}" y2="{h}" stroke="#d6d3d1"/>'
            f'<text x="{w + 4}" y="10">{rate_text(top)}/s</text><text x="{w + 4}" y="{h}">0</text>'
            f'<text x="0" y="{h + 14}">+0 s</text><text x="{w}" y="{h + 14}" text-anchor="end">'
            f'+{secs(series["bucket_seconds"] * len(values))}</text></svg>')


def svg_ladder(ladder, items):
    """The crossover ladder as lines: the cost of n items warm, cold and serverless on log-log axes,
    each break-even circled (its text in a tooltip), this run's n dashed."""
    cost = {k: (lambda n, o=o: o["fixed_usd"] + o["usd_per_item"] * n)
            for k, o in ladder["options"].items()}
    top_n = 10 ** max(6, math.ceil(math.log10(max(items, 1))) + 1)
    ends = [fn(n) for fn in cost.values() for n in (1, top_n)]
    lo, hi = math.log10(max(min(ends), 1e-12)), math.log10(max(max(ends), 1e-12))
    hi = hi if hi > lo else lo + 1
    w, h = 420, 200

    def x(n):
        return math.log10(n) / math.log10(top_n) * w

    def y(c):
        return h - (math.log10(max(c, 1e-12)) - lo) / (hi - lo) * h

    parts = [f'<svg id="ladder" width="{w + 130}" height="{h + 40}" '
             f'viewBox="-50 -10 {w + 130} {h + 40}">']
    parts += [f'<line x1="{x(10 ** k):.1f}" y1="0" x2="{x(10 ** k):.1f}" y2="{h}" '
              f'stroke="#f0efee"/><text x="{x(10 ** k):.1f}" y="{h + 14}" '
              f'text-anchor="middle">{10 ** k:,}</text>' for k in range(int(math.log10(top_n)) + 1)]
    label_y = -math.inf
    for name, fn in sorted(cost.items(), key=lambda kv: -kv[1](top_n)):   # labels top down, apart
        points = " ".join(f"{x(n):.1f},{y(fn(n)):.1f}"
                          for n in (10 ** (i / 8) for i in range(8 * int(math.log10(top_n)) + 1)))
        label_y = max(y(fn(top_n)) + 4, label_y + 12)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{LADDER_LINES[name]}" '
                     f'stroke-width="2"/><text x="{w + 4}" y="{label_y:.1f}" '
                     f'style="fill:{LADDER_LINES[name]}">{name}</text>')
    for pair in ladder["pairs"]:
        n0 = pair["break_even_items"]
        if n0 and 1 < n0 < top_n:
            parts.append(f'<circle cx="{x(n0):.1f}" cy="{y(cost[pair["a"]](n0)):.1f}" r="4" '
                         f'fill="none" stroke="#1c1917"><title>{esc(pair["text"])}</title>'
                         '</circle>')
    if items:
        parts.append(f'<line x1="{x(items):.1f}" y1="0" x2="{x(items):.1f}" y2="{h}" '
                     f'stroke="#1c1917" stroke-dasharray="3 3"/>'
                     f'<text x="{x(items) + 4:.1f}" y="10">this run</text>')
    parts.append(f'<text x="-46" y="10">${10 ** hi:.2g}</text><text x="-46" y="{h}">${10 ** lo:.2g}'
                 f'</text><text x="{w / 2}" y="{h + 28}" text-anchor="middle">items (log scale); $ '
                 f'(log scale)</text></svg>')
    wins = "; ".join(f"{k} cheapest " + (f"from {v['from']:,}" + (
        f" to {v['until']:,}" if v["until"] else " on") if v["from"] else "never")
        for k, v in ladder["wins"].items())
    return "".join(parts) + f'<p class="mute">{esc(wins)}</p>'


def cost_bars(rows):
    """Horizontal bars [(label, usd, colour)] on one scale."""
    top = max((v for _, v, _ in rows if v), default=0) or 1
    return "<table>" + "".join(
        f"<tr><td>{esc(label)}</td><td style='width:60%'><div class='bar' style='height:14px;"
        f"background:none'><span style='width:{(v or 0) / top:.1%};background:{colour}'></span>"
        f"</div></td><td class=n>{usd(v)}</td></tr>" for label, v, colour in rows) + "</table>"


def progress(view):
    items, total = view["items"], max(view["items_total"], 1)
    bar = "".join(f"<span style='width:{items[k] / total:.2%};background:{c}' title='{k}'></span>"
                  for k, c in OUTCOMES.items() if items[k])
    eta = (f"ETA {secs(view['eta_seconds'])}" if view["eta_seconds"] else
           "complete" if view["complete"] else "")
    figs = "".join(fig(f"{items[k]:,}", k.replace("_", "-"))
                   for k in ("ok", "failed", "pending", "dead_lettered", "cancelled")
                   if k != "cancelled" or items[k])
    if view["items_running_done"]:
        figs += fig(f"{view['items_running_done']:,}", "done in running claims")
    return (f'<div id="progress" data-done="{view["done_fraction"]:.6f}">'
            f'<div class="bar">{bar}</div>'
            f'<div class="figs">{figs}{fig(rate_text(view["items_per_second"]), "items/s")}'
            f'{fig(format(view["done_fraction"], ".0%"), eta)}</div></div>')


def run_body(v):
    model = link("pools", v["model"]) if v["mode"] == "pool" else esc(v["model"])
    cancelled = f"; cancelled: {esc(v['cancelled']['reason'])}" if v["cancelled"] else ""
    parts = [f"<h1>run {esc(v['run_id'])} <span class=pill>{esc(v['mode'])}</span> "
             f"{state_pill(v['state'])}</h1>"
             f"<p class=mute>model {model}, {v['items_total']:,} items in {v['claims_total']:,} "
             f"claims, created {esc(v['created_at'])}{cancelled}</p>",
             f"<section><h2>progress</h2>{progress(v)}</section>",
             f"<section><h2>claims per worker</h2>{svg_timeline(v['timeline'])}</section>",
             f"<div class=grid><section><h2>items/s over time</h2>{svg_rate(v['rate_series'])}"
             "</section>"]
    c = v["cost"]
    if c:
        cold = v["mode"] == "cold"   # its own cold counterfactual: set against a warm pool instead
        bars = [("so far", c["so_far_usd"], COLOURS["claim"]),
                ("on a warm pool", c["warm_usd"], COLOURS["enter"]) if cold else
                ("cold counterfactual", c["cold_usd"], LADDER_LINES["cold"]),
                ("serverless", c["serverless_usd"], LADDER_LINES["serverless"])]
        saving = ("a cold run is its own cold counterfactual" if cold else
                  f"against a cold acquisition it saves {usd(c['saving_usd'])}")
        parts.append(f"<section><h2>cost{' so far' if c['partial'] else ''}</h2>"
                     f"{cost_bars(bars)}<p class=mute>{c['items']:,} items priced as "
                     f"{esc(c['priced_as'])}; {saving}</p></section>")
        if c["ladder"]:
            few = c["ladder"]["too_few_claims"]
            parts.append("<section><h2>crossover ladder</h2>" + (f"<p class=mute>{esc(few)}</p>" if few else
                         svg_ladder(c["ladder"], c["items"])) + "</section>")
    parts.append(failures_section(v["failures"]) + "</div>")
    logs = "".join(f"<p class=mute>{esc(path)}</p><pre>{esc(chr(10).join(lines))}</pre>"
                   for path, lines in v["logs"].items())
    parts.append("<section><h2>worker logs (tail)</h2>"
                 f"{logs or '<p class=mute>none on this machine</p>'}</section>")
    return "".join(parts)


def failures_section(f):
    rows = "".join(f"<tr><td class=n>{g['count']:,}</td><td class=msg>{esc(g['message'])}</td>"
                   f"<td>{', '.join(map(str, g['first_items']))}</td></tr>" for g in f["groups"])
    rows += "".join(f"<tr><td class=n>claims</td><td class=msg>dead-lettered: "
                    f"{esc(d['reason'])}</td><td>{esc(d['claims'])}</td></tr>"
                    for d in f["dead_lettered"])
    table = ("<table><tr><th class=n>items</th><th>error</th><th>first items</th></tr>"
             f"{rows}</table>" if rows else "<p class=mute>none</p>")
    more = f"<p class=mute>+{f['groups_hidden']} more errors</p>" if f["groups_hidden"] else ""
    return (f"<section id=failures><h2>failures ({f['failed_items']:,} items failed)</h2>"
            f"{table}{more}</section>")


def pool_body(v):
    figs = (fig(depth(v["queue"]), "queue")
            + fig(v["dlq"]["visible"] if v["dlq"] else "?", "dead-letter")
            + fig(v["workers_running"], "workers running")
            + fig(percent(v["warm_hit_rate"]), "warm hits")
            + fig(rate_text(v["items_per_second_now"]), "items/s now"))
    return (f"<h1>pool {esc(v['model'])}</h1><div class=figs>{figs}</div>"
            f"<section><h2>claims per worker, its last {POOL_RUNS} runs</h2>"
            f"{svg_timeline(v['timeline'])}</section><div class=grid>"
            f"{workers_section(v['workers'])}{pool_cost_section(v)}</div>")


def workers_section(workers):
    rows = []
    for w in workers:
        util = (percent(w["gpu_utilisation"]) if w["gpu_utilisation"] is not None else
                f"<span title='{esc(w['gpu_note'] or '')}'>n/a</span>")
        lost = f" <span class=mute>{esc(w['lost'])}</span>" if w["lost"] else ""
        state = "ok" if w["state"] == "running" else "bad"
        restarts = "-" if w["restarts"] is None else w["restarts"]
        rows.append(f"<tr><td>{esc(w['worker_id'])}</td><td><span class='pill {state}'>"
                    f"{esc(w['state'])}</span>{lost}</td><td>{'yes' if w['warm'] else 'no'}</td>"
                    f"<td>{esc(','.join(w['gpus'] or [])) or '-'}</td><td>{util}</td>"
                    f"<td class=n>{restarts}</td><td class=n>{w['claims']}</td>"
                    f"<td class=n>{w['items']:,}</td><td class=msg>{esc(exit_text(w['last_exit']))}"
                    "</td></tr>")
    return ("<section><h2>workers</h2><table><tr><th>worker</th><th>state</th><th>warm</th>"
            "<th>GPU</th><th>GPU util</th><th class=n>restarts</th><th class=n>claims</th>"
            f"<th class=n>items</th><th>last exit</th></tr>{''.join(rows)}</table></section>")


def pool_cost_section(v):
    rows = "".join(f"<tr><td>{link('runs', r['run_id'])}"
                   f"{' <span class=pill>cold</span>' * (r['mode'] == 'cold')} "
                   f"{state_pill(r['state'])}"
                   f"</td><td style='width:30%'>{cost_pair(r)}</td><td class=n>"
                   f"{usd(r['cost_usd'])}</td><td class=n>{usd(r['cold_usd'])}</td></tr>"
                   for r in v["runs"] if r["cost_usd"])
    warm = [r for r in v["runs"] if r["cost_usd"] and r["cold_usd"]]
    paid, cold = sum(r["cost_usd"] for r in warm), sum(r["cold_usd"] for r in warm)
    total = (f"<p>these {len(warm)} warm runs paid <b>{usd(paid)}</b>; cold, each paying a fresh "
             f"acquisition and @enter, they would have cost <b>{usd(cold)}</b> "
             f"({cold / paid:,.0f}x)</p>" if warm else "")
    pc = v["pool_cost"]
    paid = (f"<p class=mute>the pool paid {usd(pc['usd'])} in all, idle included, over "
            f"{pc['workers']} workers; {pc['cold']['starts']:,.0f} cold starts would have cost "
            f"{usd(pc['cold']['usd'])}</p>" if pc and pc["workers"] else "")
    keys = (f"<span class=key style='background:{COLOURS['claim']}'></span>paid "
            f"<span class=key style='background:{LADDER_LINES['cold']}'></span>cold counterfactual")
    table = ("<table><tr><th>run</th><th></th><th class=n>paid</th><th class=n>cold</th>"
             f"</tr>{rows}</table><p class=mute>{keys}</p>" if rows else
             "<p class=mute>no run priced yet</p>")
    return (f"<section><h2>cost: the warm pool against cold</h2>{table}{total}{paid}<p class=mute>"
            f"priced as {esc(v['priced_as'])}; a cold run's line is what it paid</p></section>")


def cost_pair(r):
    top = max(r["cost_usd"], r["cold_usd"] or 0) or 1
    pairs = ((r["cost_usd"], COLOURS["claim"]), (r["cold_usd"], LADDER_LINES["cold"]))
    return "".join(f"<div class='bar thin'><span style='width:{x / top:.1%};background:{c}'>"
                   "</span></div>" for x, c in pairs if x is not None)


def exit_text(last):
    if not last:
        return ""
    if isinstance(last, dict) and "reason" in last:
        return (f"{calque_core.now_iso(last['at'])[11:19]} ({'after' if last.get('warm') else 'before'} "
                f"warm): {last['reason']}")
    return str(last)


# ------------------------------------------------------------------------------------------------
# the server: loopback unless a token guards it; GET only; each request checked before it is read
def is_loopback(host):
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NotThere(Exception):
    """A path that names nothing (no such page, pool or run): 404 with its one line."""


def route(board, path, query):
    """(content type, body) of a GET: an /api/ path answers JSON, a page path HTML (its main part
    alone with ?part=main: what the page's script polls)."""
    page = query.get("page", ["1"])[0]
    page = int(page) if page.isdigit() else 1
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
    api = parts[:1] == ["api"]
    parts, live = parts[api:], True
    try:
        if parts == [] and not api:
            pools, runs = board.pools_view(), board.runs_view(page)
            featured = featured_pool(board, pools, runs)
            view, title = None, "calque"
            body = (f"<h1>pools</h1><section>{pools_table(pools['pools'])}</section>"
                    + (pool_body(featured) if featured else "")
                    + f"<section><h2>runs</h2>{runs_table(runs, '/')}</section>")
        elif parts == ["pools"]:
            view, title = board.pools_view(), "pools"
            body = f"<h1>pools</h1><section>{pools_table(view['pools'])}</section>"
        elif parts[:1] == ["pools"] and len(parts) == 2:
            view, title = board.pool_view(parts[1]), f"pool {parts[1]}"
            body = pool_body(view)
        elif parts == ["runs"]:
            view, title = board.runs_view(page), "runs"
            body = f"<h1>runs</h1><section>{runs_table(view, '/runs')}</section>"
        elif parts[:1] == ["runs"] and len(parts) == 2:
            view, title = board.run_view(parts[1]), f"run {parts[1]}"
            body, live = run_body(view), not view["complete"]
        else:
            raise NotThere(f"no page {path}: the API is /api/pools, /api/pools/<model>, /api/runs, "
                           "/api/runs/<run>")
    except calque_core.UserError as err:
        raise NotThere(str(err)) from None
    if api:
        return "application/json", json.dumps(view, default=calque_core.to_jsonable)
    if query.get("part") == ["main"]:
        return "text/html; charset=utf-8", main_part(body, live)
    page = document(title, main_part(body, live), board.backend.describe())
    return "text/html; charset=utf-8", page


def featured_pool(board, pools, runs):
    """The pool the home page draws: the newest pool run's, if its pool exists, else the first."""
    models = [p["model"] for p in pools["pools"]]
    newest = [r["model"] for r in runs["runs"] if r["mode"] == "pool" and r["model"] in models]
    model = (newest or models or [None])[0]
    return board.pool_view(model) if model else None


def handler_class(board, token):
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "calque-dashboard"

        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            cookie = http.cookies.SimpleCookie(self.headers.get("Cookie", ""))
            given = (query.pop("token", [""])[0]
                     or self.headers.get("Authorization", "").removeprefix("Bearer ")
                     or (cookie["calque_token"].value if "calque_token" in cookie else ""))
            if token and not hmac.compare_digest(given.encode(), token.encode()):
                return self.answer(401, "text/plain", "calque dashboard: it needs its token: open "
                                                      "it once with ?token=... (kept in a cookie)")
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
            if not token and not is_loopback(host):   # another site's page, by DNS rebinding
                return self.answer(403, "text/plain", f"calque dashboard: Host {host!r} is not "
                                                      "loopback")
            status = 200
            try:
                with board.request():
                    kind, body = route(board, url.path, query)
            except NotThere as err:
                status, kind, body = 404, "text/plain; charset=utf-8", f"calque dashboard: {err}"
            except (calque_core.StoreFault, calque_core.NotFound, OSError) as err:
                status, kind, body = 503, "text/plain; charset=utf-8", f"calque dashboard: {err}"
            except Exception as err:
                aws = type(err).__module__.startswith("botocore")
                if not aws:
                    traceback.print_exc()   # a bug: its traceback on the dashboard's stderr
                line = calque_core.aws_error_line(err) if aws else f"internal error ({err!r})"
                status, kind, body = 503, "text/plain; charset=utf-8", f"calque dashboard: {line}"
            cookie = {"Set-Cookie": f"calque_token={token}; HttpOnly; SameSite=Strict; Path=/"}
            self.answer(status, kind, body, cookie if token else None)

        def answer(self, status, kind, body, extra=None):
            data = body.encode()
            self.send_response(status)
            headers = {"Content-Type": kind, "Content-Length": str(len(data)),
                       "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                       "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer", **(extra or {})}
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def refuse(self):
            self.answer(405, "text/plain", "calque dashboard is read-only: GET only",
                        {"Allow": "GET, HEAD"})

        do_HEAD = do_GET
        do_POST = do_PUT = do_DELETE = do_PATCH = refuse

        def log_message(self, fmt, *args):   # stderr: the requests that did not answer 200 only
            if not str(args[1]).startswith("2"):
                super().log_message(fmt, *args)

    return Handler


def serve(conf, backend, host, port, token, price):
    """Serve the dashboard until Ctrl-C. A host other than loopback needs a token."""
    if token is not None and not TOKEN.fullmatch(token):
        raise calque_core.UserError("--token: 8 or more of A-Z a-z 0-9 . _ ~ - (it travels in a URL) "
                               f"---> HINT: --token {secrets.token_urlsafe(16)}")
    if not is_loopback(host) and not token:
        raise calque_core.UserError(f"--host {host} lets other machines read the store: give --token "
                               f"too ---> HINT: {calque_core.command()} dashboard --host {host} --token "
                               f"{secrets.token_urlsafe(16)}")
    if not 0 <= port <= 65535:
        raise calque_core.UserError(f"--port {port}: a port is 0 to 65535 (0: any free one)")
    try:
        server = http.server.ThreadingHTTPServer((host, port), handler_class(Dashboard(
            conf, backend, price), token))
    except OSError as err:
        fix = ("--host: an address of this machine" if isinstance(err, socket.gaierror) else
               "another --port (0: any free one)")
        why = f"cannot listen on {host}:{port} ({err.strerror})"
        raise calque_core.UserError(f"{why} ---> HINT: {fix}") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"calque dashboard on http://{shown}:{server.server_address[1]}/"
          + (f"?token={token}" if token else "") + f"  ({backend.describe()}; Ctrl-C stops)",
          flush=True)
    with server:
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("calque dashboard: stopped", file=sys.stderr)


def write_report(conf, backend, run_id, path, price):
    """The run page as one self-contained HTML file: inline CSS and SVG, no script, nothing fetched.
    Returns the run's view."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise calque_core.UserError(f"--html {path}: no folder {folder} ---> HINT: create it, or write "
                               "the report elsewhere")
    view = Dashboard(conf, backend, price).run_view(run_id)
    page = document(f"run {run_id}", main_part(run_body(view), False), backend.describe(),
                    script=False)
    calque_core.write_file_atomic(path, page)
    return view
