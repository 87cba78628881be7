"""calque dashboard: a read-only live web page over a calque store (pools, runs, workers), and the run page as one
self-contained HTML file (`calque runs report RUN --html FILE`).

    calque dashboard                                  # http://127.0.0.1:8265/
    calque dashboard --host 0.0.0.0 --token SECRET    # another host: the token on every request

It reads the store only through calque.py's functions, caches each run's summaries as it reads them (a refresh
lists only the summaries past those it has and reads only the new ones, as submit's waiting does), and
aggregates on the server: a page carries charts, never claim lists. Pages and charts are HTML and hand-written
SVG made here, every store string escaped; the page's one script polls its own URL for the new main part.
The JSON API (/api/...) is documented in docs/dashboard.md.
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
import secrets
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import calque

PORT = 8265                   # the default port (Ray's dashboard's, which people already expect a dashboard on)
REFRESH_MS = 2000             # ms between two polls of a live page
POOL_TTL = 2.0                # s a pool's status (queue depths, worker stats, supervisor) is reused for
RUNS_PER_PAGE = 20            # runs of one page of the runs list
POOL_RUNS = 5                 # recent runs of a pool that its timeline and cost chart show
RECENT = 30.0                 # s of finished claims that "items/s now" and a live run's ETA are measured over
ENTER_WINDOW = 600.0          # s: a worker's @enter ended at most this long before a run's first claim is drawn
RATE_BUCKETS = 60             # bars of the items/s chart
TIMELINE_WIDTH = 900          # px of a timeline's time axis; claims narrower than MIN_BAR px merge into one bar
MIN_BAR = 4
ROWS_SHOWN = 40               # worker rows of one timeline (the ones that ran most recently)
ERROR_GROUPS = 10             # groups of item errors a run page lists
LOG_LINES, LOG_BYTES = 12, 8192   # tail of each worker log: lines shown, bytes read from the end
READERS = 16                  # parallel summary reads of a refresh
COLOURS = {"enter": "#f59e0b", "claim": "#2563eb", "partial": "#f97316", "failed": "#dc2626",
           "dead": "#7f1d1d", "startup": "#a8a29e"}
KIND_NAMES = {"enter": "@enter", "claim": "claim", "partial": "claim with failed items", "failed": "claim failed",
              "dead": "dead-lettered", "startup": "start-up (cold)"}
LADDER_LINES = {"warm": "#2563eb", "cold": "#78716c", "serverless": "#9333ea"}
e = html.escape


def epoch(text):
    return datetime.datetime.fromisoformat(text).timestamp()


# ------------------------------------------------------------------------------------------------
# the data: runs cached as read, pools reused for POOL_TTL; each view is a JSON-able dict (the API's answer)
class RunCache:
    """One run's record and the summaries read so far. A refresh of an unfinished run reads its record (a
    cancel, how far sending got) and lists the summaries past the last claim below which all are read, reading
    only the new ones; a run whose every claim has a summary is not read again. A summary once read is kept (a
    redrive's replacement shows after a restart of the dashboard)."""

    def __init__(self, run):
        self.run, self.summaries, self.times, self.below = run, {}, {}, 0
        self.order = sorted(run["claims"], key=lambda c: calque.summary_key(run["run_id"], c))
        self.cost = None   # (summaries priced, run_cost_report's answer)

    @property
    def complete(self):
        return len(self.summaries) == len(self.run["claims"])

    def refresh(self, backend):
        if self.complete:
            return
        run_id = self.run["run_id"]
        self.run = calque.read_run(backend, run_id)
        while self.below < len(self.order) and self.order[self.below] in self.summaries:
            self.below += 1
        after = self.order[self.below - 1] if self.below else None
        new = [k for k in calque.list_summaries(backend, run_id, after)
               if k.rsplit("/", 1)[1][:-5] not in self.summaries]
        with ThreadPoolExecutor(READERS) as readers:
            for s in readers.map(lambda key: calque.read_json(backend, key), new):
                self.summaries[s["claim"]] = s
                self.times[s["claim"]] = (epoch(s["started_at"]), epoch(s["finished_at"]))


class Dashboard:
    """What the pages show, read through calque.py: one lock, so that a refresh runs once at a time."""

    def __init__(self, conf, backend, price):
        self.conf, self.backend, self.price = conf, backend, price
        self.lock, self.runs, self.records, self.done_counts, self.pools = threading.RLock(), {}, {}, {}, {}

    # -- reading
    def run_cache(self, run_id):
        cache = self.runs.get(run_id)
        if cache is None:
            cache = self.runs[run_id] = RunCache(calque.read_run(self.backend, run_id))
            self.records[run_id] = cache.run
        cache.refresh(self.backend)
        self.records[run_id] = cache.run
        return cache

    def run_records(self):
        """Every run record, newest first: one LIST of runs/, a GET for each run not seen before."""
        for folder in self.backend.store.list("runs/"):
            run_id = folder.rsplit("/", 1)[1]
            if run_id not in self.records and calque.SAFE_ID.match(run_id):
                with contextlib.suppress(calque.NotFound, calque.UserError):   # a run still being staged
                    self.records[run_id] = calque.read_run(self.backend, run_id)
        return sorted(self.records.values(), key=lambda r: r["created_at"], reverse=True)

    def done_claims(self, run):
        """Claims of the run with a summary: from its cache when read, else one LIST (kept once complete)."""
        if run["run_id"] in self.runs:
            return len(self.runs[run["run_id"]].summaries)
        if run["run_id"] not in self.done_counts:
            count = len(calque.summary_claims(self.backend, run["run_id"]))
            if count < len(run["claims"]):
                return count
            self.done_counts[run["run_id"]] = count
        return self.done_counts[run["run_id"]]

    def pool_status(self, model):
        at, status = self.pools.get(model, (0, None))
        if time.monotonic() - at > POOL_TTL:
            status = calque.pool_status(self.conf, self.backend, model)
            self.pools[model] = (time.monotonic(), status)
        return status

    def pool_runs(self, model):
        """The pool's POOL_RUNS most recent pool runs, refreshed, oldest first."""
        runs = [r for r in self.run_records() if r["model"] == model and r["mode"] == "pool"][:POOL_RUNS]
        return [self.run_cache(r["run_id"]) for r in reversed(runs)]

    def run_cost(self, cache):
        """run_cost_report's (report, ladder, label, status), priced again only when new summaries came."""
        if not cache.summaries:
            return None
        if cache.cost is None or cache.cost[0] != len(cache.summaries):
            summaries = [cache.summaries[c] for c in cache.run["claims"] if c in cache.summaries]
            cache.cost = (len(summaries), calque.run_cost_report(self.backend, cache.run, summaries, self.price))
        return cache.cost[1]

    # -- views
    def pools_view(self):
        with self.lock:
            return {"pools": [self.pool_summary(m) for m in calque.list_pools(self.backend)]}

    def pool_summary(self, model):
        status, caches = self.pool_status(model), self.pool_runs(model)
        running = [w for w in status["workers"] if w.get("state") == "running"]
        claims = sum(w.get("claims", 0) for w in status["workers"])
        return {"model": model, "queue": status["queue"], "dlq": status["dlq"], "ec2": bool(status["ec2"]),
                "workers_running": len(running), "workers_local": len(status["local_workers"]),
                "warm_hit_rate": sum(w.get("warm_hits", 0) for w in status["workers"]) / claims if claims else None,
                "items_per_second_now": items_now(caches)}

    def pool_view(self, model):
        with self.lock:
            status, caches = self.pool_status(model), self.pool_runs(model)
            view = self.pool_summary(model)
            latest = latest_summaries(caches)
            view["workers"] = pool_workers(status, latest)
            stats = [w for w in status["workers"] if w.get("mode", "pool") == "pool"]
            view["timeline"] = timeline(caches, stats, live=bool(view["workers_running"]))
            view["runs"] = []
            for cache in caches:
                cost = self.run_cost(cache)
                view["runs"].append({"run_id": cache.run["run_id"], "created_at": cache.run["created_at"],
                                     "claims": len(cache.run["claims"]), "done": len(cache.summaries),
                                     "cost_usd": cost[0]["total_usd"] if cost else None,
                                     "cold_usd": cost[0]["cold"]["usd"] if cost else None})
            rates, _, rate, label = self.price
            view["pool_cost"] = calque.pool_cost(stats, rate, rates, None,
                                                 rates["defaults"]["acquisition_seconds"]["value"]) if stats else None
            view["priced_as"] = label
            return view

    def runs_view(self, page=1):
        with self.lock:
            records = self.run_records()
            pages = max(1, math.ceil(len(records) / RUNS_PER_PAGE))
            page = min(max(1, page), pages)
            shown = records[(page - 1) * RUNS_PER_PAGE:page * RUNS_PER_PAGE]
            return {"page": page, "pages": pages, "total": len(records), "runs": [
                {"run_id": r["run_id"], "model": r["model"], "mode": r["mode"], "items": r["items"],
                 "claims": len(r["claims"]), "done_claims": self.done_claims(r), "created_at": r["created_at"],
                 "cancelled": bool(r.get("cancelled"))} for r in shown]}

    def run_view(self, run_id):
        with self.lock:
            cache = self.run_cache(run_id)
            run = cache.run
            summaries = [cache.summaries[c] for c in run["claims"] if c in cache.summaries]
            view = calque.run_view(self.backend, run, summaries, dead_letters=False)
            items, now = view["items"], time.time()
            finished = items["ok"] + items["failed"]
            rate = items_now([cache]) or overall_rate(cache, now)
            cost = self.run_cost(cache)
            stats = [] if run["mode"] == "cold" else self.pool_stats(run["model"])
            out = {"run_id": run_id, "model": run["model"], "mode": run["mode"], "created_at": run["created_at"],
                   "items_total": run["items"], "claims_total": len(run["claims"]), "complete": view["complete"],
                   "cancelled": run.get("cancelled"), "items": items, "claim_counts": view["claim_counts"],
                   "queue": view["queue"], "items_per_second": rate,
                   "eta_seconds": items["pending"] / rate if rate and items["pending"] else None,
                   "done_fraction": (run["items"] - items["pending"]) / run["items"] if run["items"] else 1.0,
                   "rate_series": rate_series(cache, now),
                   "timeline": timeline([cache], stats, live=bool(items["pending"])),
                   "failures": failures(summaries, view, finished), "cost": None,
                   "logs": worker_logs(self.conf, run, self.backend)}
            if cost:
                report, ladder, label, _ = cost
                out["cost"] = {"priced_as": label, "so_far_usd": report["total_usd"], "cold_usd": report["cold"]["usd"],
                               "warm_usd": report["warm_usd"], "saving_usd": report["saving_usd"],
                               "items": report["items"], "partial": report["partial"], "ladder": ladder,
                               "serverless_usd": (ladder["options"]["serverless"]["fixed_usd"] + ladder["options"][
                                   "serverless"]["usd_per_item"] * report["items"]) if ladder else None}
            return out

    def pool_stats(self, model):
        with contextlib.suppress(calque.UserError):   # a deleted pool: its worker stats are gone with it
            return [w for w in self.pool_status(model)["workers"] if w.get("mode", "pool") == "pool"]
        return []


def items_now(caches, now=None):
    """Items a second over the last RECENT s, from the claims that finished in them (None when none did)."""
    now = time.time() if now is None else now
    done = sum(c.summaries[claim]["items"] for c in caches for claim, (_, end) in c.times.items()
               if end >= now - RECENT)
    return done / RECENT if done else None


def overall_rate(cache, now):
    if not cache.times:
        return None
    start, end = min(t[0] for t in cache.times.values()), max(t[1] for t in cache.times.values())
    span = (now if not cache.complete else end) - start
    return sum(s["items"] for s in cache.summaries.values()) / span if span > 0 else None


def rate_series(cache, now):
    """[(seconds from the first claim's start, items/s)] in RATE_BUCKETS buckets, each claim's items spread
    evenly over its span."""
    if not cache.times:
        return {"bucket_seconds": 0, "values": []}
    t0 = min(t[0] for t in cache.times.values())
    t1 = max(max(t[1] for t in cache.times.values()), now if not cache.complete else 0)
    width = max(t1 - t0, 1e-3) / RATE_BUCKETS
    buckets = [0.0] * RATE_BUCKETS
    for claim, (start, end) in cache.times.items():
        n, span = cache.summaries[claim]["items"], max(end - start, 1e-9)
        first, last = int((start - t0) / width), min(int((end - t0) / width), RATE_BUCKETS - 1)
        for b in range(first, last + 1):
            overlap = min(end, t0 + (b + 1) * width) - max(start, t0 + b * width)
            buckets[b] += n * (overlap / span if end > start else 1.0)
    return {"bucket_seconds": width, "values": [round(b / width, 3) for b in buckets]}


def latest_summaries(caches):
    """{worker id: its most recent summary} over the cached runs."""
    latest = {}
    for cache in caches:
        for claim, s in cache.summaries.items():
            old = latest.get(s["worker_id"])
            if old is None or cache.times[claim][1] > epoch(old["finished_at"]):
                latest[s["worker_id"]] = s
    return latest


def pool_workers(status, latest):
    """The pool's workers: the running ones and the last few stopped (by their stats), each joined with its
    local supervisor slot (warm, GPUs, restarts, last exit) by pid, and its last claim's GPU utilisation; a
    local slot still loading has no stats yet and is listed too."""
    host, slots = socket.gethostname(), {w["pid"]: w for w in status["local_workers"] if w["pid"]}
    running = [w for w in status["workers"] if w.get("state") == "running"]
    stopped = sorted((w for w in status["workers"] if w.get("state") != "running"), key=lambda w: w["updated_at"])
    rows, seen = [], set()
    for w in running + stopped[-calque.STOPPED_SHOWN:]:
        slot = slots.get(w.get("pid")) if w.get("host") == host else None
        seen.add(id(slot))
        gpu = (latest.get(w["worker_id"]) or {}).get("gpu_utilisation") or {}
        rows.append({"worker_id": w["worker_id"], "state": w["state"], "lost": w.get("lost"),
                     "warm": slot["warm"] if slot else w["enter_count"] > 0 and w["state"] == "running",
                     "gpus": slot.get("gpus") if slot else None, "gpu_utilisation": gpu.get("value"),
                     "gpu_note": gpu.get("reason"), "restarts": slot["restarts"] if slot else None,
                     "last_exit": (slot or {}).get("last_exit") or w.get("exit"), "claims": w["claims"],
                     "warm_hits": w["warm_hits"], "items": w["items"], "enter_seconds": w["enter_seconds"]})
    for slot in status["local_workers"]:
        if id(slot) not in seen and slot["alive"]:
            rows.append({"worker_id": f"slot {slot['slot']} (pid {slot['pid']})", "state": "loading",
                         "warm": slot["warm"], "gpus": slot.get("gpus"), "gpu_utilisation": None, "gpu_note": None,
                         "restarts": slot["restarts"], "last_exit": slot.get("last_exit"), "claims": 0,
                         "warm_hits": 0, "items": 0, "enter_seconds": None})
    return rows


def enter_span(stats):
    """(start, end) epoch s of a worker's @enter, from its stats (None before it is done)."""
    if not stats.get("enter_count"):
        return None
    if stats.get("entered_at"):
        end = epoch(stats["entered_at"])
    else:   # stats of a worker older than entered_at: it loads right after start-up
        end = epoch(stats["started_at"]) + stats.get("acquisition_seconds", 0) + stats["enter_seconds"]
    return end - stats["enter_seconds"], end


def timeline(caches, stats, live):
    """One row per worker of the runs' claims: [start s, end s, kind, claims merged, title] bars relative to
    the window's start, claims closer than a pixel and narrower than MIN_BAR px merged into one bar. A pool
    worker's @enter comes from its stats (when it ended within ENTER_WINDOW s of the first claim); a cold claim
    pays its start-up and @enter inside itself."""
    segments = {}
    for cache in caches:
        for claim, s in cache.summaries.items():
            if s["status"] == "cancelled":
                continue
            start, end = cache.times[claim]
            kind = "dead" if s.get("error") else {"ok": "claim", "partial": "partial"}.get(s["status"], "failed")
            title = (f"{cache.run['run_id']} {claim}: {s['items']} items, {s['claim_seconds']:.2f} s"
                     + (f", {len(s['failed'])} failed" if s["failed"] else "") + (", warm" if s["warm_hit"] else ""))
            row = segments.setdefault(s["worker_id"], [])
            paid = s.get("enter_seconds_paid", 0)
            if paid:
                row.append((start - s.get("acquisition_seconds", 0), start, "startup", "start-up"))
                row.append((start, start + paid, "enter", f"@enter {paid:.2f} s (in the claim)"))
                start = min(start + paid, end)
            row.append((start, end, kind, title))
    if not segments:
        return {"start": None, "seconds": 0, "rows": []}
    first = min(seg[0] for row in segments.values() for seg in row)
    for w in stats:
        span = enter_span(w)
        if span and w["worker_id"] in segments and span[1] >= first - ENTER_WINDOW:
            segments[w["worker_id"]].append((span[0], span[1], "enter", f"@enter {w['enter_seconds']:.2f} s"))
    t0 = min(seg[0] for row in segments.values() for seg in row)
    t1 = max(seg[1] for row in segments.values() for seg in row)
    t1 = max(t1, time.time()) if live else t1
    span, rows = max(t1 - t0, 1e-3), []
    pixel = span / TIMELINE_WIDTH
    for worker, row in sorted(segments.items(), key=lambda kv: min(s[0] for s in kv[1])):
        bars = []
        for start, end, kind, title in sorted(row):
            last = bars[-1] if bars else None
            if (last and last[2] == kind and start - (t0 + last[1]) < pixel
                    and min(end - start, last[1] - last[0]) < MIN_BAR * pixel):
                last[1], last[3], last[4] = max(last[1], end - t0), last[3] + 1, None
            else:
                bars.append([start - t0, end - t0, kind, 1, title])
        rows.append({"worker_id": worker, "claims": sum(b[3] for b in bars if b[2] != "enter"),
                     "enters": sum(1 for b in bars if b[2] == "enter"),
                     "bars": [[round(b[0], 3), round(b[1], 3), *b[2:]] for b in bars]})
    hidden = max(0, len(rows) - ROWS_SHOWN)
    return {"start": calque.now_iso(t0), "seconds": span, "rows": rows[hidden:], "rows_hidden": hidden}


def failures(summaries, view, failed_or_ok):
    """Failed items grouped by error (count, first items, one message) and dead-lettered claims by reason."""
    groups = calque.item_errors(summaries)
    dead = {}
    for claim, v in view["claims"].items():
        if v["state"] == "dead-lettered":
            dead.setdefault(v["detail"], []).append(claim)
    return {"failed_items": view["items"]["failed"], "groups": [
        {"message": message, "count": len(indices), "first_items": sorted(indices)[:calque.FIRST_ITEMS_SHOWN]}
        for message, indices in groups[:ERROR_GROUPS]], "groups_hidden": max(0, len(groups) - ERROR_GROUPS),
        "dead_lettered": [{"reason": r, "claims": calque.claim_list(c)} for r, c in dead.items()]}


def worker_logs(conf, run, backend):
    """{log path: its last LOG_LINES lines} of the run's workers on this machine (a local pool's slots, a cold
    run's shards), or {"": where they are} for an EC2 pool."""
    if run["mode"] == "cold":
        folder = os.path.join(os.path.abspath(conf["CALQUE_STATE"]), "runs", run["run_id"])
    else:
        folder = calque.state_dir(conf, run["model"])
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
# the pages: HTML and SVG strings, every value from the store through e()
CSS = """
:root{--ink:#1c1917;--mute:#78716c;--line:#e7e5e4;--card:#fff;--bg:#f5f5f4}
*{box-sizing:border-box}body{margin:0;font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;color:var(--ink);
background:var(--bg)}header{background:#1c1917;color:#fafaf9;padding:10px 24px;display:flex;gap:18px;
align-items:baseline}header a{color:#fafaf9;text-decoration:none;font-weight:600}header .where{color:#a8a29e;
font-size:12px}#live{margin-left:auto;font-size:12px;color:#a8a29e}main{padding:16px 24px;max-width:1280px}
h1{font-size:20px;margin:4px 0 12px}h2{font-size:15px;margin:0 0 8px}section{background:var(--card);
border:1px solid var(--line);border-radius:8px;padding:14px 16px;margin-bottom:14px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:14px}.grid section{margin:0}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid
var(--line);white-space:nowrap}th{color:var(--mute);font-weight:500;font-size:12px}td.n,th.n{text-align:right;
font-variant-numeric:tabular-nums}.mute{color:var(--mute)}.msg{white-space:pre-wrap;word-break:break-word}
.bar{display:flex;height:18px;border-radius:4px;overflow:hidden;background:#e7e5e4;margin:6px 0}
.bar span{display:block}.figs{display:flex;gap:22px;flex-wrap:wrap;margin:6px 0}.figs b{font-size:18px;
display:block}.key{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px}
pre{background:#1c1917;color:#e7e5e4;padding:8px 10px;border-radius:6px;overflow-x:auto;font-size:12px;
margin:4px 0 10px}a{color:#1d4ed8}.pill{padding:1px 7px;border-radius:9px;font-size:12px;background:#e7e5e4}
.ok{background:#dcfce7}.bad{background:#fee2e2}svg text{font:11px system-ui,sans-serif;fill:#57534e}
"""
SCRIPT = """(() => {
  const main = document.getElementById("main"), live = document.getElementById("live");
  let last = null;
  async function tick() {
    if (document.hidden || main.dataset.live !== "1") return;
    const url = new URL(location.href); url.searchParams.set("part", "main");
    try {
      const r = await fetch(url, {cache: "no-store", credentials: "same-origin"});
      if (!r.ok) { live.textContent = "update failed: HTTP " + r.status; return; }
      const text = await r.text();
      if (text !== last) {
        const box = document.createElement("div"); box.innerHTML = text;
        const fresh = box.firstElementChild; main.replaceWith(fresh); last = text;
        fresh.dataset.updates = String(Number(main.dataset.updates || 0) + 1);
      }
      live.textContent = "live, updated " + new Date().toLocaleTimeString();
    } catch (err) { live.textContent = "dashboard unreachable; retrying"; }
  }
  setInterval(() => tick().then(() => { }), %d);
  live.textContent = main.dataset.live === "1" ? "live" : "";
})();"""


def usd(x):
    return "-" if x is None else calque._usd(x)


def secs(s):
    if s is None:
        return "-"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def link(kind, name):
    return f'<a href="/{kind}/{urllib.parse.quote(name, safe="")}">{e(name)}</a>'


def document(title, main, where, script=True):
    """A whole page. Served: with the polling script (its nonce in the CSP). A report: no script at all."""
    nonce = secrets.token_urlsafe(12)
    csp = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
           + (f"script-src 'nonce-{nonce}'; connect-src 'self'" if script else "script-src 'none'"))
    js = f'<script nonce="{nonce}">{SCRIPT % REFRESH_MS}</script>' if script else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" '
            f'content="{csp}"><meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<title>{e(title)}</title><style>{CSS}</style></head><body><header><a href="/">calque</a>'
            f'<span class="where">{e(where)}</span><span id="live"></span></header>{main}{js}</body></html>')


def main_part(body, live):
    return f'<main id="main" data-live="{1 if live else 0}">{body}</main>'


def depth(q):
    return "?" if q is None else f"{q['visible']} visible, {q['in_flight']} in flight"


def percent(x):
    return "-" if x is None else f"{x:.0%}"


def rate_text(x):
    return "-" if x is None else f"{x:,.1f}"


def pools_table(pools):
    if not pools:
        return '<p class="mute">no pools in this store</p>'
    rows = "".join(
        f"<tr><td>{link('pools', p['model'])}{' <span class=pill>EC2</span>' if p['ec2'] else ''}</td>"
        f"<td>{depth(p['queue'])}</td><td class=n>{p['dlq']['visible'] if p['dlq'] else '?'}</td>"
        f"<td class=n>{p['workers_running']}</td><td class=n>{percent(p['warm_hit_rate'])}</td>"
        f"<td class=n>{rate_text(p['items_per_second_now'])}</td></tr>" for p in pools)
    return ("<table><tr><th>pool</th><th>queue</th><th class=n>dead-letter</th><th class=n>workers running</th>"
            f"<th class=n>warm hits</th><th class=n>items/s now</th></tr>{rows}</table>")


def runs_table(view, base):
    rows = []
    for r in view["runs"]:
        done = r["done_claims"] / r["claims"] if r["claims"] else 1
        state = "cancelled" if r["cancelled"] else "done" if done == 1 else "running"
        rows.append(f"<tr><td>{link('runs', r['run_id'])}</td><td>{e(r['model'])}</td><td>{e(r['mode'])}</td>"
                    f"<td class=n>{r['items']:,}</td><td style='width:160px'><div class=bar style='height:8px'>"
                    f"<span style='width:{done:.1%};background:{COLOURS['claim']}'></span></div></td>"
                    f"<td class=n>{r['done_claims']}/{r['claims']}</td><td>{state}</td>"
                    f"<td class=mute>{e(r['created_at'])}</td></tr>")
    pager = " ".join(f'<a href="{base}?page={p}">{p}</a>' if p != view["page"] else f"<b>{p}</b>"
                     for p in range(1, view["pages"] + 1)) if view["pages"] > 1 else ""
    return ("<table><tr><th>run</th><th>model</th><th>mode</th><th class=n>items</th><th>progress</th>"
            f"<th class=n>claims</th><th>state</th><th>created</th></tr>{''.join(rows)}</table>"
            f"<p class=mute>{view['total']} run(s), newest first. {pager}</p>" if view["runs"] else
            '<p class="mute">no runs yet</p>')


def svg_timeline(tl):
    """The claims of each worker as bars on one time axis; the track shows through where the worker idled."""
    if not tl["rows"]:
        return '<p class="mute">no claim has finished yet</p>'
    label, row_h, width = 190, 22, TIMELINE_WIDTH
    height = len(tl["rows"]) * row_h + 24
    scale = width / tl["seconds"]
    parts = [f'<svg id="timeline" width="{label + width + 10}" height="{height}" role="img" '
             f'viewBox="0 0 {label + width + 10} {height}">']
    for i, row in enumerate(tl["rows"]):
        y = i * row_h
        parts.append(f'<g class="worker" data-worker="{e(row["worker_id"])}" data-claims="{row["claims"]}" '
                     f'data-enters="{row["enters"]}"><text x="0" y="{y + 15}">{e(row["worker_id"][-28:])}</text>'
                     f'<rect x="{label}" y="{y + 3}" width="{width}" height="{row_h - 6}" fill="#f5f5f4"/>')
        for start, end, kind, count, title in row["bars"]:
            x, w = label + start * scale, max((end - start) * scale, 1.0)
            w = w - 1 if w >= MIN_BAR and count == 1 else w
            tip = title or f"{count} claims, {end - start:.2f} s"
            parts.append(f'<rect class="{kind}" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                         f'fill="{COLOURS[kind]}"><title>{e(tip)}</title></rect>')
        parts.append("</g>")
    axis = len(tl["rows"]) * row_h + 14
    for k in range(6):
        x = label + width * k / 5
        parts.append(f'<text x="{x:.0f}" y="{axis}" text-anchor="middle">+{secs(tl["seconds"] * k / 5)}</text>')
    parts.append("</svg>")
    kinds = {b[2] for row in tl["rows"] for b in row["bars"]}
    legend = "".join(f'<span class="key" style="background:{COLOURS[k]}"></span>{KIND_NAMES[k]}'
                     for k in COLOURS if k in kinds) + '<span class="key" style="background:#f5f5f4;border:1px ' \
                                                         'solid #d6d3d1"></span>idle'
    more = f" ({tl['rows_hidden']} older workers not shown)" if tl.get("rows_hidden") else ""
    return (f'<div style="overflow-x:auto">{"".join(parts)}</div><p class="mute">from {e(tl["start"])}{more}: '
            f'{legend}</p>')


def svg_rate(series):
    values = series["values"]
    if not values:
        return '<p class="mute">no claim has finished yet</p>'
    w, h, top = 460, 120, max(values) or 1
    step = w / len(values)
    bars = "".join(f'<rect x="{i * step:.1f}" y="{h - v / top * h:.1f}" width="{max(step - 1, 1):.1f}" '
                   f'height="{v / top * h:.1f}" fill="#93c5fd"/>' for i, v in enumerate(values) if v)
    return (f'<svg width="{w + 60}" height="{h + 20}" viewBox="0 0 {w + 60} {h + 20}">{bars}'
            f'<line x1="0" y1="{h}" x2="{w}" y2="{h}" stroke="#d6d3d1"/>'
            f'<text x="{w + 4}" y="10">{rate_text(top)}/s</text><text x="{w + 4}" y="{h}">0</text>'
            f'<text x="0" y="{h + 14}">0</text><text x="{w}" y="{h + 14}" text-anchor="end">'
            f'+{secs(series["bucket_seconds"] * len(values))}</text></svg>')


def svg_ladder(ladder, items):
    """The crossover ladder as lines: cost of n items warm, cold and serverless on log-log axes, the break-evens
    marked, and this run's n."""
    opts = ladder["options"]
    lo_n, hi_n = 1, 10 ** max(6, math.ceil(math.log10(max(items, 1))) + 1)
    cost = {k: (lambda n, o=o: o["fixed_usd"] + o["usd_per_item"] * n) for k, o in opts.items()}
    values = [cost[k](n) for k in cost for n in (lo_n, hi_n)]
    lo_c, hi_c = math.log10(max(min(values), 1e-9)), math.log10(max(max(values), 1e-9))
    hi_c = hi_c if hi_c > lo_c else lo_c + 1
    w, h = 440, 200
    x = lambda n: (math.log10(n) - math.log10(lo_n)) / (math.log10(hi_n) - math.log10(lo_n)) * w  # noqa: E731
    y = lambda c: h - (math.log10(max(c, 1e-9)) - lo_c) / (hi_c - lo_c) * h  # noqa: E731
    parts = [f'<svg id="ladder" width="{w + 90}" height="{h + 40}" viewBox="-40 -10 {w + 130} {h + 40}">']
    for k in range(int(math.log10(hi_n)) + 1):
        parts.append(f'<line x1="{x(10 ** k):.1f}" y1="0" x2="{x(10 ** k):.1f}" y2="{h}" stroke="#f5f5f4"/>'
                     f'<text x="{x(10 ** k):.1f}" y="{h + 14}" text-anchor="middle">{10 ** k:,}</text>')
    for name, fn in cost.items():
        points = " ".join(f"{x(n):.1f},{y(fn(n)):.1f}" for n in (10 ** (i / 8) for i in range(
            int(8 * math.log10(hi_n)) + 1)))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{LADDER_LINES[name]}" stroke-width="2"/>'
                     f'<text x="{w + 4}" y="{y(fn(hi_n)) + 4:.1f}" fill="{LADDER_LINES[name]}">{name}</text>')
    for pair in ladder["pairs"]:
        n0 = pair["break_even_items"]
        if n0 and lo_n < n0 < hi_n:
            parts.append(f'<circle cx="{x(n0):.1f}" cy="{y(cost[pair["a"]](n0)):.1f}" r="4" fill="none" '
                         f'stroke="#1c1917"><title>{e(pair["text"])}</title></circle>')
    if items:
        parts.append(f'<line x1="{x(items):.1f}" y1="0" x2="{x(items):.1f}" y2="{h}" stroke="#1c1917" '
                     f'stroke-dasharray="3 3"/><text x="{x(items) + 4:.1f}" y="10">this run</text>')
    parts.append(f'<text x="-36" y="{y(10 ** hi_c) + 4:.1f}">{usd(10 ** hi_c)}</text>'
                 f'<text x="-36" y="{h}">{usd(10 ** lo_c)}</text>'
                 f'<text x="{w / 2}" y="{h + 28}" text-anchor="middle">items (log)</text></svg>')
    wins = "; ".join(f"{k} cheapest " + (f"from {v['from']:,}" + (f" to {v['until']:,}" if v["until"] else " on")
                                         if v["from"] else "never") for k, v in ladder["wins"].items())
    return "".join(parts) + f'<p class="mute">{e(wins)}</p>'


def cost_bars(rows):
    """Horizontal bars [(label, usd, colour)] on one scale."""
    top = max((v for _, v, _ in rows if v), default=0) or 1
    return "<table>" + "".join(
        f"<tr><td>{e(label)}</td><td style='width:60%'><div class=bar style='height:14px;background:none'>"
        f"<span style='width:{(v or 0) / top:.1%};background:{colour}'></span></div></td><td class=n>{usd(v)}</td>"
        f"</tr>" for label, v, colour in rows) + "</table>"


def progress(view):
    items, total = view["items"], max(view["items_total"], 1)
    spans = [("ok", "#16a34a"), ("failed", "#dc2626"), ("dead_lettered", "#7f1d1d"), ("cancelled", "#a8a29e")]
    bar = "".join(f"<span style='width:{items[k] / total:.2%};background:{c}' title='{k}'></span>"
                  for k, c in spans if items[k])
    eta = f"ETA {secs(view['eta_seconds'])}" if view["eta_seconds"] else "complete" if view["complete"] else ""
    figs = "".join(f"<div><b>{items[k]:,}</b><span class=mute>{k.replace('_', '-')}</span></div>"
                   for k in ("ok", "failed", "pending", "dead_lettered", "cancelled") if k != "cancelled" or items[k])
    return (f'<div id="progress" data-done="{view["done_fraction"]:.6f}" data-ok="{items["ok"]}">'
            f'<div class="bar">{bar}</div><div class="figs">{figs}<div><b>{rate_text(view["items_per_second"])}'
            f'</b><span class=mute>items/s</span></div><div><b>{view["done_fraction"]:.0%}</b>'
            f'<span class=mute>{e(eta)}</span></div></div></div>')


def run_body(v):
    parts = [f"<h1>run {e(v['run_id'])} <span class=pill>{e(v['mode'])}</span></h1><p class=mute>model "
             f"{link('pools', v['model']) if v['mode'] == 'pool' else e(v['model'])}, {v['items_total']:,} items in "
             f"{v['claims_total']:,} claims, created {e(v['created_at'])}"
             + (f"; cancelled: {e(v['cancelled']['reason'])}" if v["cancelled"] else "") + "</p>",
             f"<section><h2>progress</h2>{progress(v)}</section>",
             f"<section><h2>claims per worker</h2>{svg_timeline(v['timeline'])}</section>", '<div class="grid">',
             f"<section><h2>items/s over time</h2>{svg_rate(v['rate_series'])}</section>"]
    c = v["cost"]
    if c:
        bars = [("so far", c["so_far_usd"], COLOURS["claim"]), ("cold counterfactual", c["cold_usd"], "#78716c"),
                ("serverless", c["serverless_usd"], LADDER_LINES["serverless"])]
        parts.append(f"<section><h2>cost{' (so far)' if c['partial'] else ''}</h2>{cost_bars(bars)}<p class=mute>"
                     f"{c['items']:,} items priced as {e(c['priced_as'])}; saving against cold {usd(c['saving_usd'])}"
                     f"</p></section>")
        if c["ladder"]:
            parts.append(f"<section><h2>crossover ladder</h2>{svg_ladder(c['ladder'], c['items'])}</section>")
    f = v["failures"]
    rows = "".join(f"<tr><td class=n>{g['count']:,}</td><td class=msg>{e(g['message'])}</td>"
                   f"<td>{', '.join(map(str, g['first_items']))}</td></tr>" for g in f["groups"])
    rows += "".join(f"<tr><td class=n>claims</td><td class=msg>dead-lettered: {e(d['reason'])}</td>"
                    f"<td>{e(d['claims'])}</td></tr>" for d in f["dead_lettered"])
    parts.append(f"<section id=failures><h2>failures ({f['failed_items']:,} items failed)</h2>" + (
        f"<table><tr><th class=n>items</th><th>error</th><th>first items</th></tr>{rows}</table>" if rows else
        "<p class=mute>none</p>") + (f"<p class=mute>+{f['groups_hidden']} more errors</p>" if f["groups_hidden"]
                                     else "") + "</section></div>")
    logs = "".join(f"<p class=mute>{e(path)}</p><pre>{e(chr(10).join(lines))}</pre>" for path, lines in
                   v["logs"].items())
    parts.append(f"<section><h2>worker logs (tail)</h2>{logs or '<p class=mute>none on this machine</p>'}</section>")
    return "".join(parts)


def pool_body(v, runs_bars=True):
    rows = "".join(
        f"<tr><td>{e(w['worker_id'])}</td><td><span class='pill {'ok' if w['state'] == 'running' else 'bad'}'>"
        f"{e(w['state'])}</span>{' ' + e(w['lost']) if w.get('lost') else ''}</td>"
        f"<td>{'yes' if w['warm'] else 'no'}</td><td>{e(','.join(w['gpus'])) if w['gpus'] else '-'}</td>"
        f"<td>{percent(w['gpu_utilisation']) if w['gpu_utilisation'] is not None else e(w['gpu_note'] or '-')}</td>"
        f"<td class=n>{'-' if w['restarts'] is None else w['restarts']}</td><td class=n>{w['claims']}</td>"
        f"<td class=n>{w['warm_hits']}</td><td class=n>{w['items']:,}</td><td class=msg>"
        f"{e(exit_text(w['last_exit']))}</td></tr>" for w in v["workers"])
    parts = [f"<h1>pool {e(v['model'])}</h1><div class=figs><div><b>{depth(v['queue'])}</b><span class=mute>queue"
             f"</span></div><div><b>{v['dlq']['visible'] if v['dlq'] else '?'}</b><span class=mute>dead-letter</span>"
             f"</div><div><b>{v['workers_running']}</b><span class=mute>workers running</span></div><div><b>"
             f"{percent(v['warm_hit_rate'])}</b><span class=mute>warm hits</span></div><div><b>"
             f"{rate_text(v['items_per_second_now'])}</b><span class=mute>items/s now</span></div></div>",
             f"<section><h2>claims per worker (its last {POOL_RUNS} runs)</h2>{svg_timeline(v['timeline'])}</section>",
             '<div class="grid">',
             "<section><h2>workers</h2><table><tr><th>worker</th><th>state</th><th>warm</th><th>GPU</th><th>GPU util"
             "</th><th class=n>restarts</th><th class=n>claims</th><th class=n>warm hits</th><th class=n>items</th>"
             f"<th>last exit</th></tr>{rows}</table></section>"]
    costs = "".join(
        f"<tr><td>{link('runs', r['run_id'])}</td><td style='width:45%'>{cost_pair(r)}</td><td class=n>"
        f"{usd(r['cost_usd'])}</td><td class=n>{usd(r['cold_usd'])}</td></tr>" for r in v["runs"] if r["cost_usd"])
    pc = v["pool_cost"]
    line = (f"<p class=mute>the pool paid {usd(pc['usd'])} in all, idle included ({pc['workers']} workers); "
            f"{pc['cold']['starts']:,.0f} cold starts would have cost {usd(pc['cold']['usd'])}</p>"
            if pc and pc["workers"] else "")
    parts.append(f"<section><h2>cost: warm pool against cold</h2>" + (
        f"<table><tr><th>run</th><th><span class=key style='background:{COLOURS['claim']}'></span>warm "
        f"<span class=key style='background:#78716c'></span>cold</th><th class=n>warm</th><th class=n>cold</th>"
        f"</tr>{costs}</table>" if costs else "<p class=mute>no run priced yet</p>")
        + f"{line}<p class=mute>priced as {e(v['priced_as'])}</p></section></div>")
    return "".join(parts)


def cost_pair(r):
    top = max(r["cost_usd"], r["cold_usd"]) or 1
    return "".join(f"<div class=bar style='height:7px;margin:2px 0;background:none'><span style='width:"
                   f"{x / top:.1%};background:{c}'></span></div>" for x, c in ((r["cost_usd"], COLOURS["claim"]),
                                                                           (r["cold_usd"], "#78716c")))


def exit_text(last):
    if not last:
        return ""
    if isinstance(last, dict) and "reason" in last:
        return (calque.now_iso(last["at"])[11:19] + f" ({'after' if last.get('warm') else 'before'} warm): "
                + str(last["reason"]))
    return str(last)


def home_body(pools, runs, featured):
    return ("<h1>pools</h1><section>" + pools_table(pools["pools"]) + "</section>"
            + (pool_body(featured) if featured else "") + "<section><h2>runs</h2>" + runs_table(runs, "/")
            + "</section>")


# ------------------------------------------------------------------------------------------------
# the server: loopback unless --token; GET only; every request checked before anything is read
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host):
    try:
        return host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class NotThere(Exception):
    """A page or API path that names nothing: 404 with its one line."""


def route(board, path, query):
    """(content type, body) of a GET: an API path answers JSON, a page path HTML (its main part alone with
    ?part=main, which the page's script polls)."""
    page = int(query.get("page", ["1"])[0]) if query.get("page", ["1"])[0].isdigit() else 1
    parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")] if path.strip("/") else []
    api = parts[:1] == ["api"]
    parts = parts[1:] if api else parts
    try:
        if not parts:
            pools, runs = board.pools_view(), board.runs_view(page)
            if api:
                raise NotThere("/api has /api/pools, /api/pools/<model>, /api/runs, /api/runs/<run>")
            featured = featured_pool(board, pools, runs)
            body, title, live = home_body(pools, runs, featured), "calque", True
        elif parts == ["pools"]:
            view = board.pools_view()
            body, title, live = ("<h1>pools</h1><section>" + pools_table(view["pools"]) + "</section>", "pools",
                                 True)
        elif parts[0] == "pools" and len(parts) == 2:
            view = board.pool_view(parts[1])
            body, title, live = pool_body(view), f"pool {parts[1]}", True
        elif parts == ["runs"]:
            view = board.runs_view(page)
            body, title, live = "<h1>runs</h1><section>" + runs_table(view, "/runs") + "</section>", "runs", True
        elif parts[0] == "runs" and len(parts) == 2:
            view = board.run_view(parts[1])
            body, title, live = run_body(view), f"run {parts[1]}", not view["complete"]
        else:
            raise NotThere(f"no page {path}")
    except calque.UserError as err:
        raise NotThere(str(err)) from None
    if api:
        return "application/json", json.dumps(view, default=calque.to_jsonable)
    if query.get("part") == ["main"]:
        return "text/html; charset=utf-8", main_part(body, live)
    return "text/html; charset=utf-8", document(title, main_part(body, live), board.backend.describe())


def featured_pool(board, pools, runs):
    """The pool the home page draws: that of the newest pool run whose pool still exists, else the first pool."""
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
            given = (query.pop("token", [""])[0] or self.headers.get("Authorization", "").removeprefix("Bearer ")
                     or (cookie["calque_token"].value if "calque_token" in cookie else ""))
            if token and not hmac.compare_digest(given.encode(), token.encode()):
                return self.answer(401, "text/plain", "calque dashboard: a token is required: open the URL with "
                                                      "?token=... once (it is kept in a cookie)")
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]")
            if not token and not is_loopback(host):   # a page of another site, reaching us by DNS rebinding
                return self.answer(403, "text/plain", f"calque dashboard: Host {host!r} is not this machine")
            try:
                with board.lock:
                    kind, body = route(board, url.path, query)
                status = 200
            except NotThere as err:
                kind, body, status = "text/plain; charset=utf-8", f"calque dashboard: {err}", 404
            except (calque.StoreFault, calque.NotFound) as err:
                kind, body, status = "text/plain; charset=utf-8", f"calque dashboard: the store failed: {err}", 503
            extra = {"Set-Cookie": f"calque_token={token}; HttpOnly; SameSite=Strict; Path=/"} if token else {}
            self.answer(status, kind, body, extra)

        def answer(self, status, kind, body, extra=None):
            data = body.encode()
            self.send_response(status)
            for key, value in {"Content-Type": kind, "Content-Length": str(len(data)), "Cache-Control": "no-store",
                               "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                               "Referrer-Policy": "no-referrer", **(extra or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def refuse(self):
            self.answer(405, "text/plain", "calque dashboard is read-only: GET only", {"Allow": "GET, HEAD"})

        do_HEAD = do_GET
        do_POST = do_PUT = do_DELETE = do_PATCH = refuse

        def log_message(self, fmt, *args):   # one line a request on stderr, as http.server does, but quieter
            if not str(args[1]).startswith("2"):
                super().log_message(fmt, *args)

    return Handler


def serve(conf, backend, host, port, token, price):
    """Serve the dashboard until Ctrl-C. A host other than loopback needs a token."""
    if not is_loopback(host) and not token:
        raise calque.UserError(f"--host {host} lets other machines read the store: give --token SECRET too (every "
                               f"request must carry it) ---> HINT: calque dashboard --host {host} --token "
                               f"{secrets.token_urlsafe(16)}")
    board = Dashboard(conf, backend, price)
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    try:
        server = http.server.ThreadingHTTPServer((host, port), handler_class(board, token))
    except OSError as err:
        raise calque.UserError(f"cannot listen on {host}:{port} ({err.strerror}) ---> HINT: another --port") from None
    shown = f"[{host}]" if ":" in host else host
    print(f"calque dashboard on http://{shown}:{server.server_address[1]}/"
          + (f"?token={token}" if token else "") + f"  ({backend.describe()}; Ctrl-C stops)", flush=True)
    with server:
        server.serve_forever()


def write_report(conf, backend, run_id, path, price):
    """The run page as one self-contained HTML file: inline CSS and SVG, no script, nothing fetched."""
    board = Dashboard(conf, backend, price)
    view = board.run_view(run_id)
    calque.write_file_atomic(path, document(f"run {run_id}", main_part(run_body(view), False), backend.describe(),
                                            script=False))
    return view
