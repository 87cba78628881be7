"""The cost model: rates, a run's and a pool's cost, the cold counterfactual, the crossover ladder
(docs/cost.md). Stands on calque_core."""
import json, math, typing

from calque_core import (REQUEST_KEYS, UserError, _parse_time, command, package_file,
                         read_worker_stats)


# ------------------------------------------------------------------------------------------------
# 7. the cost model
# Per claim a worker pays fixed (@enter paid + acquisition) and variable (the drain) seconds at its
# instance's rate, plus its requests. A warm pool pays `fixed` once per worker; the cold
# counterfactual prices the same run as fresh acquisitions. Formulas: docs/cost.md.
RATES_VERSION = 1                                     # rates.json schema this code reads
LADDER_ITEMS = (10, 100, 1_000, 10_000, 100_000)      # item counts the crossover ladder prices
LADDER_MIN_CLAIMS = 3                                 # finished claims a run's ladder extrapolates from: one
                                                      # or two measure their start and writes more than c
TIE_REL = 1e-9                                        # costs this close are a tie (float noise)


def load_rates(path=None):
    """Read and validate a rates file (default: the bundled one); a UserError names a bad field."""
    path = str(path or package_file("calque_data", "rates.json"))
    try:
        with open(path, encoding="utf-8") as f:
            rates = json.load(f)
    except FileNotFoundError:
        raise UserError(f"rates file {path} not found ---> HINT: pass --rates FILE, or restore rates.json") from None
    except OSError as e:
        raise UserError(f"rates file {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"rates file {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    _check_rates(rates, path)
    rates["_file"] = path  # for error messages that list known names
    return rates


def _field_name(keys):
    """('ec2', 'instances', 'g5.xlarge', 'usd_per_hour') -> ec2.instances['g5.xlarge'].usd_per_hour."""
    out = ""
    for k in keys:
        out += f"['{k}']" if "." in k else (f".{k}" if out else k)
    return out


_NUMBER_CHECKS = {  # kind: (test, what the message asks for)
    "positive": (lambda v: v > 0, "a positive number"),
    "nonneg": (lambda v: v >= 0, "a number >= 0"),
    "fraction": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "count": (lambda v: isinstance(v, int) and v >= 0, "a whole number >= 0"),
}


def _rates_field(rates, keys, file, kind=None):
    """The value at `keys`, checked: a _NUMBER_CHECKS name, a type (str, int, bool, dict) or None."""
    node = rates
    for i, k in enumerate(keys):
        if not isinstance(node, dict) or k not in node:
            raise UserError(f"rates file {file}: missing field {_field_name(keys[:i + 1])}")
        node = node[k]
    if isinstance(kind, str):
        test, want = _NUMBER_CHECKS[kind]
        number = isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node)
        if not (number and test(node)):
            raise UserError(f"rates file {file}: {_field_name(keys)} must be {want}, got {node!r}")
    elif kind is not None and (not isinstance(node, kind) or (kind is int and isinstance(node, bool))):
        raise UserError(f"rates file {file}: {_field_name(keys)} must be a {kind.__name__}, got {node!r}")
    return node


def _sourced(rates, keys, file, field="value", kind="positive"):
    """The figure at keys + (field,), checked; every figure says where it came from and when."""
    value = _rates_field(rates, keys + (field,), file, kind)
    _rates_field(rates, keys + ("source",), file, str)
    _rates_field(rates, keys + ("as_of",), file, str)
    return value


def _check_rates(rates, file):
    if not isinstance(rates, dict):
        raise UserError(f"rates file {file}: top level must be a JSON object")
    version = _rates_field(rates, ("version",), file, int)
    if version != RATES_VERSION:
        raise UserError(f"rates file {file}: version {version} is not supported (this calque reads "
                        f"version {RATES_VERSION})")
    _rates_field(rates, ("updated",), file, str)
    instances = _rates_field(rates, ("ec2", "instances"), file, dict)
    cards = _rates_field(rates, ("serverless", "cards"), file, dict)
    for name, found in (("ec2.instances", instances), ("serverless.cards", cards)):
        if not found:
            raise UserError(f"rates file {file}: {name} is empty")
    for name in instances:
        keys = ("ec2", "instances", name)
        _sourced(rates, keys, file, "usd_per_hour")
        if not _rates_field(rates, keys + ("gpus",), file, "count"):
            # a CPU instance: its serverless stand-in is a container of its size
            _rates_field(rates, keys + ("vcpus",), file, "positive")
            _rates_field(rates, keys + ("memory_gib",), file, "positive")
            continue
        _rates_field(rates, keys + ("gpu",), file, str)
        card = _rates_field(rates, keys + ("serverless_card",), file, str)
        if card not in cards:
            raise UserError(f"rates file {file}: {_field_name(keys + ('serverless_card',))} "
                            f"{card!r} is not in serverless.cards ({', '.join(cards)})")
    for name in ("spot_fraction", "savings_plan_fraction"):
        _sourced(rates, ("ec2", name), file, kind="fraction")
    for name in cards:
        _sourced(rates, ("serverless", "cards", name), file, "usd_per_second")
    _rates_field(rates, ("serverless", "gpu_rate_includes_cpu_memory"), file, bool)
    for name in ("cpu_usd_per_core_second", "memory_usd_per_gib_second"):
        _sourced(rates, ("serverless", name), file)
    _rates_field(rates, ("serverless", "container_per_gpu", "cpu_cores"), file, "nonneg")
    _rates_field(rates, ("serverless", "container_per_gpu", "memory_gib"), file, "nonneg")
    for name in ("sqs_usd_per_million", "s3_put_usd_per_thousand", "s3_get_usd_per_thousand"):
        _sourced(rates, ("requests", name), file)
    optional = ("cpu_instance_type",) if "cpu_instance_type" in rates.get("defaults", {}) else ()
    for name in ("instance_type", *optional):
        default_type = _rates_field(rates, ("defaults", name, "value"), file, str)
        if default_type not in instances:
            raise UserError(f"rates file {file}: defaults.{name} {default_type!r} is not in ec2.instances")
    _rates_field(rates, ("defaults", "acquisition_seconds", "value"), file, "nonneg")


def _known(names):
    return ", ".join(sorted(names, key=str.lower))


def instance_rate_per_second(rates, instance_type, spot=False, savings_plan=False):
    """$/s for one instance: on-demand, or scaled by the file's spot or savings-plan fraction."""
    instances = rates["ec2"]["instances"]
    if instance_type not in instances:
        raise UserError(f"no rate for instance type {instance_type!r} in {rates.get('_file', 'the rates file')}; "
                        f"known: {_known(instances)} ---> HINT: pick one, or add it to a --rates FILE")
    if spot and savings_plan:
        raise UserError("an instance is priced as spot or under a savings plan, not both")
    option = "spot_fraction" if spot else "savings_plan_fraction" if savings_plan else None
    fraction = rates["ec2"][option]["value"] if option else 1.0
    return instances[instance_type]["usd_per_hour"] * fraction / 3600.0


def serverless_rate_per_second(rates, card, count=1):
    """$/s for `count` serverless GPUs of `card` (any case), plus the CPU and memory a container
    reserves per GPU when the card rate excludes them (Modal bills them apart)."""
    cards = rates["serverless"]["cards"]
    key = next((k for k in cards if k.lower() == str(card).lower()), None)
    if key is None:
        raise UserError(f"no serverless rate for GPU card {card!r} in "
                        f"{rates.get('_file', 'the rates file')}; known: {_known(cards)}")
    per_gpu = cards[key]["usd_per_second"]
    if not rates["serverless"]["gpu_rate_includes_cpu_memory"]:
        shape = rates["serverless"]["container_per_gpu"]
        per_gpu += (shape["cpu_cores"] * rates["serverless"]["cpu_usd_per_core_second"]["value"]
                    + shape["memory_gib"] * rates["serverless"]["memory_usd_per_gib_second"]["value"])
    return count * per_gpu


def serverless_stand_in(rates, instance_type):
    """($/s, what it is) of the serverless container standing in for this instance: its GPUs (the
    card and count), or a CPU container of its cores (vCPUs / 2) and memory."""
    instance_rate_per_second(rates, instance_type)  # same unknown-type error
    inst, per = rates["ec2"]["instances"][instance_type], rates["serverless"]
    if inst["gpus"]:
        return (serverless_rate_per_second(rates, inst["serverless_card"], inst["gpus"]),
                f"{inst['gpus']}x {inst['serverless_card']}")
    return (inst["vcpus"] / 2 * per["cpu_usd_per_core_second"]["value"]
            + inst["memory_gib"] * per["memory_usd_per_gib_second"]["value"],
            f"{inst['vcpus'] / 2:g} cores + {inst['memory_gib']:g} GiB")


def price_label(rates, instance_type, spot=False, savings_plan=False):
    """'g5.xlarge (1x A10G) on-demand $1.006/h, rates.json 2026-11-29': what a cost is priced as."""
    per_hour = instance_rate_per_second(rates, instance_type, spot, savings_plan) * 3600
    inst = rates["ec2"]["instances"][instance_type]
    option = "spot" if spot else "savings plan" if savings_plan else "on-demand"
    shape = f"{inst['gpus']}x {inst['gpu']}" if inst["gpus"] else f"{inst['vcpus']} vCPU, no GPU"
    return (f"{instance_type} ({shape}) {option} {_usd(per_hour)}/h, "
            f"{rates.get('_file', 'rates')} {rates['updated']}")


def request_counts(requests):
    """All REQUEST_KEYS, missing ones as 0 (an older worker). An unknown key is a ValueError: the
    worker and this model share these names, and a typo must fail a test rather than go unpriced."""
    requests = requests or {}
    unknown = set(requests) - set(REQUEST_KEYS)
    if unknown:
        raise ValueError(f"unknown request counter(s) {sorted(unknown)}; known: {', '.join(REQUEST_KEYS)}")
    counts = {k: requests.get(k, 0) for k in REQUEST_KEYS}
    for k, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"request counter {k} must be a count >= 0, got {v!r}")
    return counts


def _add_counts(many):
    many = [request_counts(counts) for counts in many]
    return {k: sum(counts[k] for counts in many) for k in REQUEST_KEYS}


def request_cost(rates, requests):
    """$ for these request counts at SQS + S3 Standard prices, whatever the backend (as if on AWS)."""
    n = request_counts(requests)
    r = rates["requests"]
    sqs = n["queue_receives"] + n["queue_empty_receives"] + n["queue_other"]
    return (sqs * r["sqs_usd_per_million"]["value"] / 1e6
            + n["store_gets"] * r["s3_get_usd_per_thousand"]["value"] / 1e3
            + (n["store_puts"] + n["store_lists"]) * r["s3_put_usd_per_thousand"]["value"] / 1e3)


def _seconds(record, key, what, default=None):
    v = record.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UserError(f"{what}: field {key!r} is missing or not a number >= 0 (got {v!r})")
    return float(v)


def _claim_label(summary):
    return f"summary of claim {summary.get('claim', '?')} of run {summary.get('run_id', '?')}"


def claim_cost(summary, rate_per_s, rates):
    """One claim's fixed (@enter paid + acquisition) and variable (drain) seconds, priced."""
    what = _claim_label(summary)
    enter = _seconds(summary, "enter_seconds_paid", what)
    acquisition = _seconds(summary, "acquisition_seconds", what, default=0.0)
    claim_seconds = _seconds(summary, "claim_seconds", what)
    fixed = enter + acquisition
    variable = max(0.0, claim_seconds - enter)  # clamp: clocks read at different points can cross
    request_usd = request_cost(rates, summary.get("requests"))
    return {
        "enter_seconds": enter, "acquisition_seconds": acquisition,
        "fixed_seconds": fixed, "variable_seconds": variable, "instance_seconds": fixed + variable,
        "fixed_usd": fixed * rate_per_s, "variable_usd": variable * rate_per_s,
        "request_usd": request_usd, "total_usd": (fixed + variable) * rate_per_s + request_usd,
    }


def _check_numbers(**values):
    for name, v in values.items():
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a number >= 0, got {v!r}")


def measured_enter_seconds(worker_stats):
    """Mean @enter seconds over every @enter the pool's workers recorded, or None if none has."""
    count = sum(w.get("enter_count", 0) for w in worker_stats)
    return sum(w.get("enter_seconds", 0.0) for w in worker_stats) / count if count else None


def run_cost(summaries, rate_per_s, rates, enter_seconds, acquisition_seconds, *,
             enter_status="measured", acquisition_status="assumed", shards=1,
             expected_claims=None, backend="aws"):
    """Price a run from its claim summaries: actual, warm, cold (`shards` fresh acquisitions) and
    the saving (docs/cost.md); fewer summaries than expected_claims is partial."""
    _check_numbers(enter_seconds=enter_seconds, acquisition_seconds=acquisition_seconds)
    claims = [claim_cost(s, rate_per_s, rates) for s in summaries]
    items = sum(int(_seconds(s, "items", _claim_label(s))) for s in summaries)
    ok = sum(int(_seconds(s, "ok", _claim_label(s))) for s in summaries)
    fixed = sum(c["fixed_seconds"] for c in claims)
    variable = sum(c["variable_seconds"] for c in claims)
    requests = _add_counts(s.get("requests") for s in summaries)
    request_usd = request_cost(rates, requests)
    total = sum(c["total_usd"] for c in claims)
    cold_fixed = shards * (acquisition_seconds + enter_seconds)
    cold_usd = (cold_fixed + variable) * rate_per_s + request_usd
    saving = cold_usd - total if abs(cold_usd - total) >= 1e-8 else 0.0   # less: float noise
    notes = []
    partial = expected_claims is not None and len(summaries) < expected_claims
    if partial:
        notes.append(f"partial: {len(summaries)} of {expected_claims} claims have finished; figures cover those only")
    missing = [str(s.get("claim", "?")) for s in summaries if "requests" not in s]
    if missing:
        notes.append(f"claim(s) {', '.join(missing)} recorded no request counts: priced as 0 requests")
    if any(s.get("receive_count", 1) > 1 for s in summaries):
        notes.append("some claims were redelivered: work lost with a dropped lease is in no summary and not priced")
    if backend == "local":
        notes.append("seconds and requests are priced as if on AWS; the local backend itself pays nothing")
    return {
        "claims": len(summaries), "expected_claims": expected_claims, "partial": partial,
        "items": items, "ok": ok, "failed": items - ok,
        "warm_hits": sum(1 for s in summaries if s.get("warm_hit")), "rate_per_second": rate_per_s,
        "fixed_seconds": fixed, "variable_seconds": variable, "instance_seconds": fixed + variable,
        "enter_seconds_paid": sum(c["enter_seconds"] for c in claims),
        "acquisition_seconds": sum(c["acquisition_seconds"] for c in claims),
        "fixed_usd": fixed * rate_per_s, "variable_usd": variable * rate_per_s,
        "requests": requests, "request_usd": request_usd,
        "requests_basis": "billed on SQS + S3" if backend == "aws" else "as if on SQS + S3",
        "total_usd": total, "usd_per_1000_items": total / items * 1000 if items else None,
        "seconds_per_item": variable / items if items else None,  # the ladder's c
        "warm_usd": variable * rate_per_s + request_usd,
        "cold": {"shards": shards, "acquisition_seconds": acquisition_seconds,
                 "enter_seconds": enter_seconds, "fixed_seconds": cold_fixed, "variable_seconds": variable,
                 "instance_seconds": cold_fixed + variable, "fixed_usd": cold_fixed * rate_per_s,
                 "usd": cold_usd},
        "saving_usd": saving, "saving_fraction": saving / cold_usd if cold_usd > 0 else None,
        "inputs": {"instance rate": "published (rates file)", "claim seconds": "measured",
                   "request counts": "measured", "@enter seconds": enter_status,
                   "acquisition seconds": acquisition_status},
        "notes": notes,
    }


def _tie(x, y):
    return math.isclose(x, y, rel_tol=TIE_REL, abs_tol=1e-15)


def _first_int_above(x):
    """Smallest integer n > x, reading an x within float noise of an integer k as exactly k."""
    k = round(x)
    return k + 1 if _tie(x, k) else math.floor(x) + 1


def _last_int_below(x):
    return -_first_int_above(-x)


def _cheaper_interval(fx, sx, fy, sy):
    """Open interval (lo, hi) of real n where fx + sx*n < fy + sy*n, or None if there is none."""
    a, b = fy - fx, sy - sx  # cost_y - cost_x = a + b*n
    if _tie(sx, sy):
        return (-math.inf, math.inf) if a > 0 and not _tie(fx, fy) else None
    n0 = -a / b
    return (n0, math.inf) if b > 0 else (-math.inf, n0)


def _pair(name_x, x, name_y, y):
    """Break-even between two options (fixed $, $ per item) and who is cheaper on each side."""
    (fx, sx), (fy, sy) = x, y
    out = {"a": name_x, "b": name_y, "break_even_items": None}
    if _tie(sx, sy):
        cheaper = None if _tie(fx, fy) else (name_x if fx < fy else name_y)
        out.update(cheaper_below=cheaper, cheaper_above=cheaper, wins_from=None,
                   text=(f"{name_x} = {name_y} at every n" if cheaper is None else
                         f"{cheaper} cheaper at every n: same $ per item, {_usd(abs(fx - fy))} less up front"))
        return out
    n0 = (fy - fx) / (sx - sy)  # fx + sx*n0 == fy + sy*n0
    below, above = (name_x, name_y) if sx > sy else (name_y, name_x)
    out.update(break_even_items=n0, cheaper_below=below, cheaper_above=above,
               wins_from=max(1, _first_int_above(n0)))
    last, tie = _last_int_below(n0), (f" (tie at {round(n0):,})" if _tie(n0, round(n0)) else "")
    if n0 <= 0:
        out["text"] = f"{above} cheaper at every n: no more up front and less per item"
    elif last < 1:   # items are whole: no fraction of one is shown
        out["text"] = f"{above} cheaper from the first item" if not tie else f"{above} cheaper from 2 items{tie}"
    else:
        out["text"] = f"{below} cheaper up to {_items(last)}, {above} from {out['wins_from']:,}{tie}"
    return out


def _items(n):
    return f"{n:,} item" + ("" if n == 1 else "s")


def crossover_ladder(c, E, A, instance_rate, serverless_rate, item_counts=LADDER_ITEMS, request_usd_per_item=0.0):
    """Cost of n items warm, cold and serverless, and the n where each starts to win.
    c: seconds per item, E: @enter s, A: acquisition s, rates in $/s, request_usd_per_item: the
    pool's requests per item. Each option is a line fixed + slope*n (docs/cost.md); an option wins
    at n when it is strictly cheaper than both others, so ties win nothing."""
    _check_numbers(c=c, E=E, A=A, request_usd_per_item=request_usd_per_item)
    for name, v in (("instance_rate", instance_rate), ("serverless_rate", serverless_rate)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a positive rate, got {v!r}")
    r, R, q = instance_rate, serverless_rate, request_usd_per_item
    # name: (fixed $, $ per item)
    options = {"warm": (0.0, r * c + q), "cold": (r * (A + E), r * c + q), "serverless": (R * E, R * c)}
    names, rows = list(options), []
    for n in item_counts:
        cost = {k: f + s * n for k, (f, s) in options.items()}
        low = min(cost.values())
        rows.append({"items": n, **{f"{k}_usd": v for k, v in cost.items()},
                     "cheapest": " = ".join(k for k in names if _tie(cost[k], low))})
    pairs = [_pair(x, options[x], y, options[y]) for i, x in enumerate(names) for y in names[i + 1:]]
    wins = {}
    for x in names:
        lo, hi, reasons = 0.0, math.inf, []  # items are integers n >= 1, i.e. n > 0
        for y in (y for y in names if y != x):
            span = _cheaper_interval(*options[x], *options[y])
            reasons.append(_span_reason(x, options[x], y, options[y], span))
            lo, hi = (math.inf, -math.inf) if span is None else (max(lo, span[0]), min(hi, span[1]))
        first = _first_int_above(lo) if math.isfinite(lo) else None
        last = _last_int_below(hi) if math.isfinite(hi) else None
        if first is None or (last is not None and first > last):
            wins[x] = {"from": None, "until": None, "reason": "never: " + "; ".join(r for r in reasons if r)}
        else:
            wins[x] = {"from": first, "until": last, "reason": None}
    return {
        "inputs": {"c": c, "E": E, "A": A, "instance_rate": r, "serverless_rate": R, "request_usd_per_item": q},
        "options": {k: {"fixed_usd": f, "usd_per_item": s} for k, (f, s) in options.items()},
        "rows": rows, "pairs": pairs, "wins": wins,
        "assumptions": [
            f"warm excludes the pool's idle time between runs: see `{command()} pool cost` for what idling costs",
            "serverless runs at the same seconds per item on the like-for-like card, pays @enter on one "
            "cold start, no acquisition, no per-request fee, and no idle tail after the last item",
        ],
    }


def _span_reason(x, fx_sx, y, fy_sy, span):
    """How x's cheaper-than-y span limits where x can win ('' when x beats y at every n >= 1)."""
    (fx, sx), (fy, sy) = fx_sx, fy_sy
    if span is None:
        if _tie(fx, fy):
            return f"ties with {y} at every n"
        return f"same $ per item as {y} but {_usd(fx - fy)} more up front"
    lo, hi = span
    if math.isinf(hi):
        return "" if lo < 1 else f"cheaper than {y} only from {_items(_first_int_above(lo))}"
    if hi <= 0:
        return f"{y} costs no more up front ({_usd(fy)} vs {_usd(fx)}) and less per item ({_usd(sy)} vs {_usd(sx)})"
    if _last_int_below(hi) < 1:   # cheaper only below one item: items are whole
        return (f"{y} cheaper from the first item ({_usd(sy)} vs {_usd(sx)} per item outweighs "
                f"{_usd(fy - fx)} up front)")
    return f"cheaper than {y} only up to {_items(_last_int_below(hi))}"


def pool_cost(worker_stats, rate_per_s, rates, cold_enter_seconds, acquisition_seconds, since=None,
              cold_starts=None, acquisition_status="assumed"):
    """What a pool paid, idle included, against serving its traffic cold, and its idle budget
    (docs/cost.md). N: the claims unless cold_starts; E: the measured mean @enter. With `since`,
    an earlier worker is prorated by time and its @enter falls outside."""
    enter_status = "measured" if cold_enter_seconds is None else "given"
    if cold_enter_seconds is None:
        cold_enter_seconds = measured_enter_seconds(worker_stats)
        if cold_enter_seconds is None:
            cold_enter_seconds, enter_status = 0.0, "unknown: no worker has recorded an @enter yet (0 used)"
    since_t = _parse_time(since, "--since") if since is not None else None
    notes, t = [], dict(workers=0, alive=0.0, busy=0.0, enter=0.0, enter_count=0, claims=0.0,
                        warm_hits=0.0, items=0.0)
    window_requests, prorated = [], False
    for i, w in enumerate(worker_stats):
        what = f"stats of worker {w.get('worker_id', i)}"
        share, enter_in_window = 1.0, True
        if since_t is not None:
            started = _parse_time(w.get("started_at"), what + ": started_at")
            updated = _parse_time(w.get("updated_at"), what + ": updated_at")
            if updated < since_t:
                continue
            if started < since_t:
                life = (updated - started).total_seconds()
                share = (updated - since_t).total_seconds() / life if life > 0 else 0.0
                enter_in_window, prorated = False, True
                notes.append(f"worker {w.get('worker_id', i)} started before --since: counters prorated to {share:.0%}")
        t["workers"] += 1
        t["alive"] += share * _seconds(w, "alive_seconds", what)
        t["busy"] += share * _seconds(w, "busy_seconds", what)
        if enter_in_window:
            t["enter"] += _seconds(w, "enter_seconds", what, default=0.0)
            t["enter_count"] += int(_seconds(w, "enter_count", what, default=0))
        for k in ("claims", "warm_hits", "items"):
            t[k] += share * _seconds(w, k, what, default=0)
        window_requests.append({k: share * v for k, v in request_counts(w.get("requests")).items()})
    requests = _add_counts(window_requests)
    request_usd = request_cost(rates, requests)
    idle = max(0.0, t["alive"] - t["busy"])
    drain = max(0.0, t["busy"] - t["enter"])
    n_cold = t["claims"] if cold_starts is None else cold_starts
    per_start = acquisition_seconds + cold_enter_seconds
    pool_usd = t["alive"] * rate_per_s + request_usd
    cold_usd = (n_cold * per_start + drain) * rate_per_s + request_usd
    budget = n_cold * per_start - t["enter"]
    if t["workers"] == 0:
        notes.append("no worker stats in the window")
    return {
        "workers": t["workers"], "instance_seconds": t["alive"], "busy_seconds": t["busy"],
        "drain_seconds": drain, "enter_seconds": t["enter"], "enter_count": t["enter_count"],
        "idle_seconds": idle, "busy_fraction": t["busy"] / t["alive"] if t["alive"] else None,
        "claims": t["claims"], "warm_hits": t["warm_hits"], "items": t["items"],
        "requests": requests, "request_usd": request_usd, "usd": pool_usd,
        "usd_per_1000_items": pool_usd / t["items"] * 1000 if t["items"] else None,
        "drain_usd_per_1000_items": drain * rate_per_s / t["items"] * 1000 if t["items"] else None,
        "cold": {"starts": n_cold, "acquisition_seconds": acquisition_seconds,
                 "enter_seconds": cold_enter_seconds, "usd": cold_usd},
        "warm_beats_cold": pool_usd < cold_usd, "idle_budget_seconds": budget,
        "idle_headroom_seconds": budget - idle,
        "idle_budget_per_claim_seconds": budget / n_cold / t["workers"] if n_cold and t["workers"] else None,
        "idle_per_claim_seconds": idle / n_cold / t["workers"] if n_cold and t["workers"] else None,
        "inputs": {
            "instance rate": "published (rates file)",
            "alive/busy seconds, claims, items": "measured (prorated)" if prorated else "measured",
            "@enter seconds": enter_status, "acquisition seconds": acquisition_status,
            "cold starts": "assumed: one per claim" if cold_starts is None else "given",
        },
        "notes": notes,
    }


class Pricing(typing.NamedTuple):
    """What a cost is priced with: rates, instance type, its $/s and label, the purchase option,
    whether the user named the type (else work that used no GPU is priced as CPU: choose_pricing),
    and the serverless container standing in for the instance: its $/s and what it is."""
    rates: dict
    instance_type: str
    rate_per_s: float
    label: str
    spot: bool = False
    savings_plan: bool = False
    chosen: bool = True
    serverless_rate: float = 0.0
    serverless: str = ""


def pricing(rates_file=None, instance_type=None, spot=False, savings_plan=False, rates=None):
    """The Pricing of a rates file and an instance type (defaults: the bundled file, its type)."""
    rates = rates or load_rates(rates_file)
    chosen, instance_type = instance_type is not None, instance_type or rates["defaults"]["instance_type"]["value"]
    rate = instance_rate_per_second(rates, instance_type, spot=spot, savings_plan=savings_plan)
    return Pricing(rates, instance_type, rate, price_label(rates, instance_type, spot=spot, savings_plan=savings_plan),
                   spot, savings_plan, chosen, *serverless_stand_in(rates, instance_type))


def used_no_gpu(records):
    """True when the workers of these claim summaries, or these workers' stats, said they saw no GPU
    (NVML absent or without a device), every one that says (a cancelled or dead-lettered claim's
    summary, run by no worker, does not)."""
    said = [(r.get("gpu_utilisation") or {}).get("reason") or r.get("no_gpu") or "" for r in records
            if "gpu_utilisation" in r or "no_gpu" in r]
    return bool(said) and all(reason.startswith("no ") for reason in said)


def choose_pricing(price, records):
    """The one choice of instance and serverless stand-in that plan, submit, cost, pool cost, the
    dashboard and the report all price with: `price` (the cost options given) for the work that
    `records` (claim summaries or worker stats) describe. Default-priced work is priced as the one
    EC2 instance type its workers ran on (an EC2 pool's or cold run's); else, where it saw no GPU,
    as the rates file's defaults.cpu_instance_type, or, without one, its label says a GPU price was
    assumed."""
    def priced_as(instance_type, why):
        priced = pricing(instance_type=instance_type, spot=price.spot,
                         savings_plan=price.savings_plan, rates=price.rates)
        return priced._replace(label=f"{priced.label}: {why} (--instance-type prices another)",
                               chosen=False)

    if price.chosen:
        return price
    ran_on = {r.get("instance_type") for r in records} - {None}
    if len(ran_on) == 1 and next(iter(ran_on)) in price.rates["ec2"]["instances"]:
        return priced_as(ran_on.pop(), "the type the workers ran on")
    if not used_no_gpu(records):
        return price
    cpu = price.rates["defaults"].get("cpu_instance_type", {}).get("value")
    if cpu is None:
        return price._replace(label=f"{price.label}; a GPU price assumed for work that used no "
                                    "GPU (the rates file names no defaults.cpu_instance_type)")
    return priced_as(cpu, "no worker saw a GPU")


def pool_cost_report(worker_stats, price, since=None):
    """(report, label) of a pool from its workers' stats: pool_cost at choose_pricing's price, A the
    rates file's acquisition (assumed), E the workers' measured mean."""
    price = choose_pricing(price, worker_stats)
    report = pool_cost(worker_stats, price.rate_per_s, price.rates, None,
                       price.rates["defaults"]["acquisition_seconds"]["value"], since=since)
    return report, price.label


def run_cost_report(backend, run, summaries, price):
    """(report, ladder, label, status) of a run. E is measured; A is the rates file's assumption
    for a pool run, and its measured start-up for a cold one (its own counterfactual)."""
    price = choose_pricing(price, summaries)
    rates, rate = price.rates, price.rate_per_s
    if run["mode"] == "cold":
        paid = [s for s in summaries if s["enter_seconds_paid"] > 0]
        if paid:
            enter = sum(s["enter_seconds_paid"] for s in paid) / len(paid)
            acquisition = sum(s["acquisition_seconds"] for s in paid) / len(paid)
            enter_status = acquisition_status = "measured (this cold run)"
        else:
            enter, acquisition, enter_status, acquisition_status = 0.0, 0.0, "unknown (no claim paid one)", "unknown"
        shards = max(1, len({s["worker_id"] for s in paid}))
    else:
        enter = measured_enter_seconds(read_worker_stats(backend, run["model"]))
        enter_status = "measured (pool workers' mean)" if enter is not None else "unknown (no worker stats; 0 used)"
        enter, shards = enter or 0.0, 1
        acquisition = rates["defaults"]["acquisition_seconds"]["value"]
        acquisition_status = "assumed (rates.json defaults: a fresh EC2 instance)"
    report = run_cost(summaries, rate, rates, enter, acquisition, enter_status=enter_status,
                      acquisition_status=acquisition_status, shards=shards,
                      expected_claims=len(run["claims"]), backend=backend.kind)
    ladder = None
    if report["seconds_per_item"] is not None:
        ladder = crossover_ladder(report["seconds_per_item"], enter, acquisition, rate, price.serverless_rate,
                                  request_usd_per_item=report["request_usd"] / report["items"])
        ladder["too_few_claims"] = (f"not enough claims to extrapolate: {report['claims']} finished, the "
                                    f"ladder needs {LADDER_MIN_CLAIMS}" if report["claims"] < LADDER_MIN_CLAIMS
                                    else None)
    status = {"c": "measured", "E": enter_status.split(" ")[0], "A": acquisition_status.split(" ")[0],
              "q": "measured", "R": f"published, {price.serverless}"}
    return report, ladder, price.label, status


def _usd(x):
    """Dollars: cents from $100, else 6 significant figures; $0 below a millionth of a cent."""
    if abs(x) < 1e-8:
        return "$0"
    sign, x = ("-" if x < 0 else ""), abs(x)
    if x >= 100:
        return f"{sign}${x:,.2f}"
    digits = max(2, 5 - math.floor(math.log10(x)))
    text = f"{x:.{digits}f}".rstrip("0")
    if len(text.split(".")[1]) < 2:
        text = f"{x:.2f}"
    return f"{sign}${text}"


def _inputs_and_notes(report):
    return (["  inputs    " + "; ".join(f"{k}: {v}" for k, v in report["inputs"].items())]
            + [f"  note      {note}" for note in report["notes"]])


def format_run_cost(report, priced_as):
    """The lines `submit` and `calque.py cost RUN` print."""
    cold, n = report["cold"], report["requests"]
    per_1000 = report["usd_per_1000_items"]
    lines = [
        f"cost      priced as {priced_as}" + ("  [PARTIAL]" if report["partial"] else ""),
        f"  fixed     {report['acquisition_seconds']:.2f} s acquisition + {report['enter_seconds_paid']:.2f} s "
        f"@enter paid = {report['fixed_seconds']:.2f} s  {_usd(report['fixed_usd'])}",
        f"  variable  {report['variable_seconds']:.2f} s (drain)  {_usd(report['variable_usd'])}",
        f"  requests  {n['queue_receives'] + n['queue_empty_receives'] + n['queue_other']:,} queue "
        f"({n['queue_empty_receives']:,} empty receives), {n['store_gets']:,} gets, "
        f"{n['store_puts'] + n['store_lists']:,} puts/lists  "
        f"{_usd(report['request_usd'])} ({report['requests_basis']})",
        f"  total     {_usd(report['total_usd'])} for {report['items']:,} items ({report['claims']} claims, "
        f"{report['warm_hits']} warm hits)" + (f" = {_usd(per_1000)} per 1,000 items" if per_1000 is not None else ""),
        f"  cold      {_usd(cold['usd'])} as a fresh acquisition: its fixed + the same variable and requests",
        f"    fixed   {cold['shards']} x ({cold['acquisition_seconds']:.2f} s acquisition + "
        f"{cold['enter_seconds']:.2f} s @enter) = {cold['fixed_seconds']:.2f} s  {_usd(cold['fixed_usd'])}",
    ]
    if report["saving_fraction"] is not None:
        lines.append(f"  saving    {_usd(report['saving_usd'])} ({report['saving_fraction']:.1%}) against cold; "
                     f"on an already-warm pool this work costs {_usd(report['warm_usd'])}")
    return lines + _inputs_and_notes(report)


def format_ladder(ladder, status):
    """The crossover table; `status` labels each input, e.g. {"c": "measured", "A": "assumed"}."""
    i = ladder["inputs"]
    lines = [
        f"ladder    c = {i['c']:.4g} s/item ({status.get('c', 'assumed')}), E = {i['E']:.4g} s @enter "
        f"({status.get('E', 'assumed')}), A = {i['A']:.4g} s acquisition ({status.get('A', 'assumed')})",
        f"          instance {_usd(i['instance_rate'] * 3600)}/h, serverless {_usd(i['serverless_rate'] * 3600)}/h "
        f"({status.get('R', 'published')}), requests {_usd(i['request_usd_per_item'])}/item "
        f"({status.get('q', 'measured')})",
    ]
    if ladder.get("too_few_claims"):
        return lines + [f"  {ladder['too_few_claims']}"]
    lines.append(f"  {'items':>9}  {'warm':>13}  {'cold':>13}  {'serverless':>13}  cheapest")
    lines += [f"  {row['items']:>9,}  {_usd(row['warm_usd']):>13}  {_usd(row['cold_usd']):>13}  "
              f"{_usd(row['serverless_usd']):>13}  {row['cheapest']}" for row in ladder["rows"]]
    for name, w in ladder["wins"].items():
        if w["from"] is None:
            lines.append(f"  {name:<10}  {w['reason']}")
        else:
            span = (f"from {w['from']:,} to {w['until']:,} items" if w["until"] is not None else
                    "at every n" if w["from"] == 1 else f"from {w['from']:,} items on")
            lines.append(f"  {name:<10}  cheapest {span}")
    lines += [f"  {p['a']} vs {p['b']}: {p['text']}" for p in ladder["pairs"]]
    lines += [f"  assumes   {a}" for a in ladder["assumptions"]]
    return lines


def format_cost_table(run_reports, priced_as):
    """`calque.py cost RUN RUN ...`: one comparison line per (run record, run_cost report)."""
    width = max(len(run["run_id"]) for run, _ in run_reports)
    header = [f"priced as {priced_as}",
              f"  {'run':<{width}} {'mode':<5} {'claims':>6} {'warm':>5} {'items':>7} "
              f"{'fixed_s':>8} {'drain_s':>8} {'total':>13} {'per 1,000 items':>16}"]
    return header + [f"  {run['run_id']:<{width}} {run['mode']:<5} {r['claims']:>6} "
                     f"{r['warm_hits']:>5} {r['items']:>7} {r['fixed_seconds']:>8.2f} "
                     f"{r['variable_seconds']:>8.3f} "
                     f"{_usd(r['total_usd']):>13} {_usd(r['usd_per_1000_items'] or 0):>16}"
                     + ("  [partial]" if r["partial"] else "") for run, r in run_reports]


def format_pool_cost(report, priced_as, model):
    """The lines `calque.py pool cost --model M` prints."""
    if report["workers"] == 0:
        return [f"pool cost {model}: no worker stats in the window"]
    per_1000, drain_1000 = report["usd_per_1000_items"], report["drain_usd_per_1000_items"]
    cold = report["cold"]
    lines = [
        f"pool cost {model}, priced as {priced_as}",
        f"  paid      {report['instance_seconds']:,.0f} instance-s over {report['workers']} "
        f"workers = {_usd(report['usd'])} (requests {_usd(report['request_usd'])})",
        f"  busy      {report['busy_fraction']:.1%} ({report['drain_seconds']:,.0f} s drain + "
        f"{report['enter_seconds']:,.0f} s @enter x{report['enter_count']}; {report['idle_seconds']:,.0f} s idle)",
        f"  traffic   {report['claims']:,.0f} claims, {report['warm_hits']:,.0f} warm hits, "
        f"{report['items']:,.0f} items",
    ]
    if per_1000 is not None:
        lines.append(f"  per 1,000 {_usd(per_1000)} with idle, {_usd(drain_1000)} drain only")
    start = cold["acquisition_seconds"] + cold["enter_seconds"]
    lines.append(f"  cold      {_usd(cold['usd'])} for {cold['starts']:,.0f} cold starts x "
                 f"({cold['acquisition_seconds']:.2f} s acquisition + {cold['enter_seconds']:.2f} s @enter) = "
                 f"{cold['starts'] * start:,.2f} s + the same drain: "
                 + ("warm is cheaper" if report["warm_beats_cold"] else "COLD would have been cheaper"))
    per_claim = report["idle_budget_per_claim_seconds"]
    lines.append(f"  idle      budget {report['idle_budget_seconds']:,.0f} instance-s, used "
                 f"{report['idle_seconds']:,.0f}, headroom {report['idle_headroom_seconds']:,.0f}"
                 + (f"; between claims the pool may idle {per_claim:,.0f} s, it idled "
                    f"{report['idle_per_claim_seconds']:,.0f} s" if per_claim is not None else ""))
    return lines + _inputs_and_notes(report)
