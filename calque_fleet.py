"""Across the fleets: where a pool's workers run (fleet_for: the Fleet interface), a Modal app's
pool options, the cold baseline, pools' status and liveness, the planner. Stands on calque_core,
calque_runs, calque_cost and the fleets (calque_supervisor; calque_ec2 through fleet_for only)."""
import argparse, contextlib, datetime, heapq, inspect, itertools, math, os, re
import shlex, socket, statistics, time, sys
from collections import Counter

from calque_core import (MODAL_GPU_ALIASES, NotFound, PLAN_GAP_MAX, SCALE_MEASURED_CLAIMS,
                         StoreFault, UserError, _parse_time, claim_id, claim_sizes,
                         cold_record_key, command, dlq_name, format_sizes, import_modal_app,
                         imports_modal, key_values, load_pool, measured_seconds, modal_param,
                         new_run_id, now_iso, parse_handler_spec, pool_queue_name, pool_settings,
                         pool_version, read_env_file, read_json, read_run, read_worker_stats, retry_policy,
                         run_key, run_queue_names, slug, snapshot_handler, state_dir,
                         version_label, version_of, volume_key, write_json)
from calque_runs import as_sizes, cancel_run, sized_claims, stage_run, wait_for_run
from calque_cost import (_usd, choose_pricing, instance_rate_per_second, load_rates,
                         measured_enter_seconds)
from calque_supervisor import (LIVE_STATES, STOPPED_SHOWN, WORKER_LOST_AFTER, LocalFleet,
                               crash_looping, gpu_devices, pid_alive, read_scaling,
                               read_supervisor)


# ------------------------------------------------------------------------------------------------
# 9. across both paths: a Modal app's pool options, the cold baseline, pools' status, the planner
def modal_gpu(gpu):
    """[(card, count)] of the cards a Modal gpu= value accepts: "H100:8", "a10g", "any" (Modal's
    T4, L4 or A10G), or a list of fallbacks (any of them); [] for none."""
    pairs = []
    for value in gpu if isinstance(gpu, (list, tuple)) else [gpu] if isinstance(gpu, str) else []:
        card, _, count = value.upper().rstrip("!").partition(":")
        pairs += [(c, int(count or 1)) for c in MODAL_GPU_ALIASES.get(card, (card,))]
    return pairs


def suggest_instance(rates, pairs):
    """The cheapest instance type in the rates with at least `count` GPUs of `card`, for any
    (card, count) of `pairs`, or None."""
    fits = [(i["usd_per_hour"], name) for name, i in rates["ec2"]["instances"].items()
            for card, count in pairs if i.get("serverless_card") == card and i["gpus"] >= count]
    return min(fits)[1] if fits else None


def modal_options(handler_spec, params=(), secrets=(), volumes=(), gpus_per_worker=None, batch_size=None,
                  workers_here=True, store=None, module=None):
    """What a Modal handler's pool needs from its app file, imported here: (the record's "modal"
    entry, the retries / max_deliveries / batch_timeout / instance_type its retries=, timeout=
    and gpu= suggest, notes); (None, {}, []) for a calque handler. `workers_here`: pip packages
    checked; `store`: where its volumes are looked for; `module`: the app file imported already."""
    path, name = parse_handler_spec(handler_spec)
    with open(path, "rb") as f:
        if not imports_modal(f.read(), path):
            if params or secrets or volumes:
                raise UserError(f"--param, --secret and --volume apply to a Modal app handler; {path} imports no modal")
            return None, {}, []
    shim, target, method = import_modal_app(path, name, module=module)
    options, notes, suggested = target.options, shim.ignored(target.options), {}
    given = key_values(params, "--param")
    declared = target.parameters() if method else {}
    for key, value in given.items():
        if key not in declared:
            raise UserError(f"--param {key}: {target.__name__} has no modal.parameter() {key} "
                            f"(it has: {', '.join(declared) or 'none'})")
        modal_param(target.user_cls, key, value)
    missing = [k for k, default in declared.items() if default is inspect.Parameter.empty and k not in given]
    if missing:
        raise UserError(f"{target.__name__}.{missing[0]} is a modal.parameter() without a default "
                        f"---> HINT: pool create --param {missing[0]}=VALUE")
    image = image_plan(options.get("image"), path)
    image["env"].update({k: str(v) for k, v in (options.get("env") or {}).items() if v is not None})
    if image["steps"]:
        where = "this Python" if workers_here else "the instance's venv, the image's packages installed at boot"
        notes.append(f"image= {' + '.join(step[0] for step in image['steps'])}: not built; the workers run in {where}")
    if workers_here:
        unmet = {req: why for req in image["pip"] if (why := pip_unmet(req))}
        if unmet:
            listed = ", ".join(f"{req} ({why})" for req, why in unmet.items())
            raise UserError(f"{path}: the image's pip_install {listed} in the workers' Python "
                            f"({sys.executable}) ---> HINT: {sys.executable} -m pip install "
                            f"{' '.join(shlex.quote(m) for m in unmet)}")
    secret_files = {k: os.path.abspath(v) for k, v in key_values(secrets, "--secret").items()}
    for secret in options["secrets"]:
        path, keys = secret_files.get(secret.name), ", ".join(secret.required_keys)
        if path and not os.path.isfile(path):
            raise UserError(f"--secret {secret.name}={path}: no such file ---> HINT: name a file of KEY=value lines")
        missing = path and [key for key in secret.required_keys
                            if key not in read_env_file(path, f"--secret {secret.name}")]
        if missing:
            raise UserError(f"secret {secret.name}: {path} lacks {', '.join(missing)} (its required_keys: {keys}) "
                            f"---> HINT: add a KEY=value line for each")
        if secret.name and not path:
            notes.append(f"secret {secret.name}: no --secret {secret.name}=FILE: its variables "
                         f"{f'({keys}) ' if keys else ''}must be in the workers' environment (pool.env)")
    mounts = modal_volumes(options["volumes"], volume_folders([target.app], volumes), store,
                           notes)
    pairs = modal_gpu(options.get("gpu"))
    fitting = [(card, count) for card, count in pairs if count <= (gpus_per_worker or 1)]
    if pairs and not fitting:
        count = min(count for _, count in pairs)
        raise UserError(f"gpu={options['gpu']!r} asks {count} GPUs per container; this pool gives "
                        f"each worker {gpus_per_worker or 1} ---> HINT: --gpus-per-worker {count}")
    if fitting:
        rates = load_rates()
        suggested["instance_type"] = name = suggest_instance(rates, fitting)
        hourly = name and _usd(rates["ec2"]["instances"][name]["usd_per_hour"])
        price = f" ({hourly}/h, the cheapest of the cards it accepts)" if name else ""
        notes.append(f"gpu={options['gpu']!r}: EC2 instance type for --instances: "
                     f"{name or 'none in rates.json'}{price}")
    retries = options.get("retries")
    if retries is not None:
        policy = retry_policy(**(retries.policy if hasattr(retries, "policy") else
                                 {"max_retries": retries}))
        suggested["retries"] = policy   # an item that raises, retried; a crash, redelivered
        suggested["max_deliveries"] = 1 + policy["max_retries"]
    if options.get("timeout"):   # a batch is one call of a @modal.batched, else one call per item
        fn = getattr(target.user_cls, method) if method else target.raw_f
        per_batch = 1 if getattr(fn, "_modal_role", {}).get("kind") == "batched" else batch_size
        suggested["batch_timeout"] = float(options["timeout"]) * (per_batch or 1)
    record = {"params": given, "secrets": secret_files, "volumes": mounts, "image": image,
              "declared": {"gpu": options.get("gpu")}}
    return record, suggested, notes


def volume_folders(apps, volumes):
    """{name: absolute folder} of the `--volume NAME=PATH` flags, each naming a volume one of
    `apps` declares and a local folder (modal run checks them once, before any pool)."""
    declared = {vol.name for app in apps for obj in app.registered.values()
                for vol in obj.options["volumes"].values()}
    folders = key_values(volumes, "--volume")
    for name, folder in folders.items():
        if name not in declared:
            raise UserError(f"--volume {name}={folder}: the app has no volume {name} (it has: "
                            f"{', '.join(sorted(declared)) or 'none'})")
        if "://" in folder or not folder:
            raise UserError(f"--volume {name}={folder}: not a local folder ---> HINT: --volume "
                            f"{name}=PATH, or leave it out: Volume {name} is then the store's "
                            f"prefix {volume_key(name)}")
        folders[name] = os.path.abspath(folder)
    return folders


def modal_volumes(declared, folders, store, notes):
    """{mount path: {"name", "folder": its volume_folders folder, if named}} of the app's
    volumes; one without a folder is the store's prefix (volume_key), which must hold a file
    unless create_if_missing (as Modal's from_name refuses a volume that does not exist)."""
    mounts = {}
    for mount, vol in declared.items():
        if not os.path.isabs(mount):   # Modal refuses it too
            raise UserError(f"volume {vol.name}: its mount {mount} is not an absolute path ---> "
                            f"HINT: volumes={{\"/{mount}\": ...}}")
        mounts[mount] = {"name": vol.name}
        if vol.name in folders:
            mounts[mount]["folder"] = folders[vol.name]
        if store is None or vol.name in folders:
            continue
        where = store.uri(volume_key(vol.name))
        if not vol.create_if_missing and next(store.walk(volume_key(vol.name)), None) is None:
            raise UserError(f"volume {vol.name} (mounted at {mount}) does not exist: {where} holds "
                            f"no file ---> HINT: modal.Volume.from_name({vol.name!r}, "
                            f"create_if_missing=True), or --volume {vol.name}=PATH (a local "
                            f"folder)")
        notes.append(f"volume {vol.name}: {where}, at {mount} in the workers")
    return mounts


def image_plan(image, app_path):
    """What an Image chain asks of the workers: {steps, pip, apt, env, files ([local path, place in
    the handler's folder] of add_local_*; Modal's /root is that folder)}."""
    plan = {"steps": [], "pip": [], "apt": [], "env": {}, "files": []}
    for name, args, kwargs in (image.steps if image is not None else ()):
        plan["steps"].append([name, [a if isinstance(a, (str, int, float, list, dict)) else str(a) for a in args],
                              {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool))}])
        flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else [a])]
        if name in ("pip_install", "uv_pip_install"):
            plan["pip"] += [str(x) for x in flat]
        elif name == "apt_install":
            plan["apt"] += [str(x) for x in flat]
        elif name == "env":
            plan["env"].update({k: str(v) for a in args for k, v in a.items()})
        elif name in ("add_local_file", "add_local_dir"):
            local, remote = str(args[0]), str(args[1] if len(args) > 1 else kwargs["remote_path"])
            beside_app = os.path.join(os.path.dirname(os.path.abspath(app_path)), local)
            local = local if os.path.exists(local) or not os.path.exists(beside_app) else beside_app
            plan["files"].append([os.path.abspath(local), modal_remote_place(remote, local)])
        elif name == "add_local_python_source":
            for source in (python_source(module, app_path) for module in flat):
                plan["files"].append([source, os.path.basename(source)])
    return plan


def modal_remote_place(remote, local):
    """A Modal container path as a place in the handler's folder: /root/x is x, another absolute
    path loses its leading slash, and a path ending in / takes the local file's name."""
    place = remote[len("/root/"):] if remote.startswith("/root/") else remote.lstrip("/")
    return os.path.join(place, os.path.basename(local)) if remote.endswith("/") else place


def python_source(module, app_path):
    """The file or package folder of `module`, found as the app file's own imports find it."""
    top = module.split(".")[0]
    for folder in (os.path.dirname(os.path.abspath(app_path)), os.getcwd(), *sys.path):
        for candidate in (os.path.join(folder, top), os.path.join(folder, top + ".py")):
            if os.path.exists(candidate):
                return candidate
    raise UserError(f"{app_path}: add_local_python_source({module!r}): no module {top} beside the app or on sys.path")


def pip_unmet(requirement):
    """None when a pip requirement ("scikit-learn~=1.5.0") is met in this Python, else why not
    ("not installed", "1.4.2 installed"); without packaging, only == and >= are checked."""
    import importlib.metadata
    try:
        from packaging.requirements import InvalidRequirement, Requirement
        try:
            req = Requirement(requirement)
            name, wanted = req.name, lambda v: req.specifier.contains(v, prereleases=True)
        except InvalidRequirement:   # a URL, a path: only its leading name is checked
            name, wanted = re.match(r"[A-Za-z0-9._-]*", requirement.strip())[0], lambda v: True
    except ImportError:
        parts = re.match(r"\s*([\w.-]*)\s*(?:\[.*?\])?\s*(?:(==|>=)\s*([0-9.]+)\s*$)?", requirement)
        name, op, pin = parts.groups()
        number = lambda v: [int(x) for x in re.findall(r"\d+", v)]   # noqa: E731
        wanted = lambda v: not op or (number(v) >= number(pin) if op == ">="   # noqa: E731
                                      else number(v) == number(pin))
    try:
        version = importlib.metadata.version(name) if name else None
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        return "not installed"
    return None if wanted(version) else f"{version} installed"


def cold_run(conf, backend, items, *, model, handler=None, shards=1, batch_size=None, claim_size=None, timeout,
             progress=True, fleet=None, options=None):
    """The baseline: fresh workers of `fleet` (default: warmd.py here) pay @enter, drain this run's
    queue and exit; the run keeps `options` (run_options). Returns (run, summaries, timed_out);
    (None, [], False) for a dry run (the fleet's calls printed, nothing staged)."""
    fleet = fleet or fleet_for(conf, backend)
    if items.reads and not fleet.here:
        raise UserError(f"{items.where}: a cold run on EC2 cannot read an s3:// prefix (its shared role "
                        f"may not) ---> HINT: run it on a pool: pool create --instances N --read "
                        f"{items.reads}")
    record = None if handler else load_pool(   # no handler named: reuse the pool's snapshot
        backend, model, f"give the cold run its code: submit --model {model} --handler file.py:Class ITEMS")
    run_id = new_run_id(model)
    queue_name, dlq = run_queue_names(run_id)
    cold = {"model": model, "slug": slug(model), "queue": queue_name, "dlq": dlq, "ephemeral": True,
            "workdir": os.getcwd(),   # the workers run where submit ran (warmd.enter_workdir)
            **pool_settings(conf, batch_size=batch_size or (record or {}).get("batch_size")), "created_at": now_iso()}
    prefix = f"runs/{run_id}/"
    stage = not fleet.dry_run        # a dry run prints the launch and writes nothing
    if handler:                      # (the handler file is still checked)
        cold["handler"] = snapshot_handler(handler, prefix, backend.store.put if stage else lambda key, data: None)
    else:
        theirs = record["handler"]
        mine = cold["handler"] = dict(theirs, key=f"{prefix}handler/{theirs['file']}")
        copies = [(mine, theirs)]
        if "include" in theirs:
            mine["include"] = dict(theirs["include"], key=f"{prefix}handler/include.tar.gz")
            copies.append((mine["include"], theirs["include"]))
        for new, old in copies if stage else ():
            backend.store.put(new["key"], backend.store.get(old["key"]))
    cold["version"] = pool_version(cold)
    shards = max(1, shards)
    if not stage:
        with fleet.cold_workers(cold, {"run_id": run_id}, shards, timeout):
            return None, [], False
    queue = backend.queues.create_queue(queue_name, cold["visibility_timeout"])
    backend.queues.create_queue(dlq, cold["visibility_timeout"])
    counted = None if claim_size else items.counted()
    if not claim_size and counted is None:   # a listing is a stream: not counted twice
        claim_size = claim_sizing(conf, backend, None, None, workers=shards)
    elif not claim_size:   # one claim per shard: the items are counted first (a stream read in)
        items, claim_size = counted, max(1, -(-counted.count // shards))
    write_json(backend, cold_record_key(run_id), cold)
    try:
        run = stage_run(backend, cold, items, claim_size, queue, "cold", run_id, options)
        with fleet.cold_workers(cold, run, shards, timeout) as exited:
            summaries, timed_out = wait_for_run(backend, run, timeout, progress=progress,
                                                stop_if=exited)
    finally:
        backend.queues.delete_queue(queue_name)
        backend.queues.delete_queue(cold["dlq"])
        with contextlib.suppress(NotFound):   # no run record: stopped while staging, nothing queued
            # the queue is gone: a claim without a summary will never run; the run record says so
            cancel_run(backend, read_json(backend, run_key(run_id)), "the cold run ended before it finished")
    return run, summaries, timed_out


def pool_status(conf, backend, model):
    """What `pool status` shows, as data: record, queues, supervisor, workers, an EC2 fleet."""
    record = load_pool(backend, model)
    fleet = fleet_for(conf, backend, record).status(record)
    supervisor = read_supervisor(conf, model)
    local = [dict(w, alive=bool(w["pid"]) and pid_alive(w["pid"]))
             for w in (supervisor["workers"] if supervisor else [])]
    return {"model": model, "version": version_of(record), "record": record, **fleet,
            "workers": mark_lost_workers(fleet["workers"]),
            "supervisor": {k: supervisor[k] for k in ("pid", "desired", "restarts")} if supervisor else None,
            "scaling": read_scaling(state_dir(conf, model)) if supervisor else None,
            "local_workers": local}


def pool_liveness(conf, backend, record):
    """("live" | "starting" | "crashing" | "none", why) for a submit: a worker warm anywhere, every
    local one dying before warm, workers loading or waking on work, or none to claim the run."""
    model = record["model"]
    status = read_supervisor(conf, model)
    local = status["workers"] if status else []
    if any(w.get("warm") for w in local):
        return "live", ""
    stats = mark_lost_workers(read_worker_stats(backend, model))
    if any(w.get("state") == "running" for w in stats):
        return "live", ""
    crashing = crash_looping(conf, model)
    if crashing:
        return "crashing", f"pool {model}: every local worker dies before it is warm: {crashing}"
    starting = max(len(local), sum(w.get("state") == "starting" for w in stats))
    if starting:
        return "starting", (f"pool {model}: {starting} worker{'s' * (starting > 1)} starting (@enter); "
                            "the run waits for them")
    waking = fleet_for(conf, backend, record).waking(record)
    if waking:
        return waking
    died = unwarmed_death(stats)
    return "none", f"pool {model} has no live worker (no supervisor on this machine, no worker running elsewhere" + (
        f"; {died})" if died else ")")


def unwarmed_death(stats, since=""):
    """'worker W died before it was warm: why' for the newest worker stats that say so (updated
    after the ISO time `since`), else None: a worker started by hand, on any machine."""
    died = [w for w in stats if w.get("state") == "stopped" and not w.get("entered_at") and w.get("exit")
            and w["updated_at"] > since]
    last = max(died, key=lambda w: w["updated_at"], default=None)
    return last and f"worker {last['worker_id']} died before it was warm: {last['exit']}"


def mark_lost_workers(stats, now=None):
    """The stats, a "running" or "starting" worker that is gone marked {"state": "lost", "lost": why}:
    its pid gone here, or elsewhere its stats older than WORKER_LOST_AFTER (a long claim may look lost)."""
    now = time.time() if now is None else now
    host, marked = socket.gethostname(), []
    for w in stats:
        if w.get("state") in LIVE_STATES:
            if w.get("host") == host and isinstance(w.get("pid"), int):
                why = None if pid_alive(w["pid"]) else f"pid {w['pid']} is gone"
            else:
                age = now - datetime.datetime.fromisoformat(w["updated_at"]).timestamp()
                why = f"no stats for {age:.0f} s" if age > WORKER_LOST_AFTER else None
            w = dict(w, state="lost", lost=why) if why else w
        marked.append(w)
    return marked


def format_pool_status(status, store_description):
    """pool_status as `pool status` prints it: queues, fleet, local workers, a table of workers."""
    q, d = status["queue"], status["dlq"]
    lines = [f"pool {status['model']}  ({status['record']['queue']} on {store_description})",
             f"  queue: {q['visible'] if q else '?'} visible, {q['in_flight'] if q else '?'} in "
             f"flight;  dead-letter: {d['visible'] if d else '?'}",
             f"  version: {version_label(status['record'])}; each worker's is in its row"]
    lines += fleet_for(None, None, status["record"]).lines(status)
    sup = status["supervisor"]
    if sup:
        alive = sum(w["alive"] for w in status["local_workers"])
        lines.append(f"  local workers: {alive} alive of {sup['desired']} desired (supervisor pid "
                     f"{sup['pid']}, {sup['restarts']} restart(s))")
        if b := status["scaling"]:
            lines.append(f"  sizes itself: {b['lo']}..{b['hi']} workers on its backlog (drain target "
                         f"{b['target_drain']:g} s; after {b['idle_window'] / 60:g} idle min -> {b['lo']})")
        lines += [format_local_worker(w) for w in status["local_workers"]]
    else:
        lines.append("  local workers: none on this machine")
    running = [w for w in status["workers"] if w.get("state") in LIVE_STATES]
    states = Counter(w.get("state") for w in status["workers"])   # '1 starting' while one is
    starting = f"{states['starting']} starting, " if states["starting"] else ""
    lines.append(f"  workers with stats: {len(status['workers'])} ({starting}{states['running']} "
                 f"running, {states['lost']} lost)")
    fallback = [w for w in running if w.get("fastbatch") == "reference"]
    if fallback:   # never silently numpy on a GPU pool
        lines.append(f"  note: {len(fallback)} running worker(s) collate with fastbatch's numpy fallback, not its C "
                     f"build: see their logs (`pool logs`) or the instance's bootstrap report")
    # every worker that ran keeps its stats (pool cost reads them); the table shows the running ones
    # and the few last stopped, so a pool that restarted often still prints a short table
    stopped = sorted((w for w in status["workers"] if w.get("state") not in LIVE_STATES), key=lambda w: w["updated_at"])
    shown = running + stopped[-STOPPED_SHOWN:]
    if shown:
        lines.append(f"    {'worker':<30} {'version':<12} {'state':<8} {'claims':>6} {'warm':>5} "
                     f"{'enter#':>6} "
                     f"{'enter_s':>8} {'items':>7} {'busy%':>6}")
        for w in sorted(shown, key=lambda w: w["started_at"]):
            busy = 100.0 * w["busy_seconds"] / w["alive_seconds"] if w["alive_seconds"] else 0.0
            lines.append(f"    {w['worker_id'][:30]:<30} {w.get('version') or '-':<12} "
                         f"{w['state']:<8} {w['claims']:>6} {w['warm_hits']:>5} "
                         f"{w['enter_count']:>6} {w['enter_seconds']:>8.2f} {w['items']:>7} {busy:>5.1f}%")
    if len(stopped) > STOPPED_SHOWN:
        lines.append(f"    (+{len(stopped) - STOPPED_SHOWN} older stopped workers: --json lists them all)")
    return lines


def format_local_worker(w):
    """One local worker's `pool status` line: slot, pid, state, GPUs, restarts, its last exit."""
    state = ("warm" if w.get("warm") else "loading") if w["alive"] else "restarting"
    gpus = f"GPU {','.join(w['gpus'])}" if w.get("gpus") else "no GPU"
    threads = f"{w['threads']} thread(s)" if w.get("threads") else "threads: its libraries' default"
    line = f"    slot {w['slot']}: pid {w['pid'] or '-'} {state}, {gpus}, {threads}, {w['restarts']} restart(s)"
    last = w.get("last_exit")
    if last:
        kind = last.get("kind") or f"{'after' if last['warm'] else 'before'} warm"
        restart = "restarted at once" if not last.get("restart_delay") else f"restart after {last['restart_delay']:g} s"
        line += f"; last exit {now_iso(last['at'])[11:19]} ({kind}, {restart}): {last['reason']}"
    return line


def format_pool_list(pools, local_workers, store_description):
    """`pool list`: each pool's queue, local workers here, EC2 fleet, or a hint when orphaned."""
    if not pools:
        return [f"no pools in {store_description}"]
    lines = []
    for p in pools:
        fleet = f"EC2 {p['in_service']}/{p['desired']} in service ({p['asg']})" if p["asg"] else "no EC2 fleet"
        orphan = "" if p["record"] else "  [no pool record: half-created? `pool delete --model M --yes` cleans it up]"
        lines.append(f"{p['model']:<40} {pool_queue_name(p['model']):<50} "
                     f"local workers here: {local_workers.get(p['model'], 0)}; {fleet}{orphan}")
    return lines


def pool_record_to_delete(backend, model, force):
    """The record `pool delete` works from. A missing one on S3 may be a half-created EC2 pool:
    {"model"} finds the rest by name and tag. A corrupt one goes only with --force."""
    try:
        return load_pool(backend, model, f"nothing to delete (`{command()} pool list` lists the pools)")
    except StoreFault:
        if not force:
            raise
    except UserError:
        if backend.kind != "aws":
            raise
    if backend.kind == "aws":
        return {"model": model}
    return {"model": model, "slug": slug(model), "queue": pool_queue_name(model), "dlq": dlq_name(model)}


# ---- the fleets: where a pool's workers run, behind one interface
def fleet_for(conf, backend, record=None, args=None):
    """The Fleet of the pool `record`, or (record None) of a new pool or a cold run as `args`, the
    verb's flags, ask: EC2 (calque_ec2.Ec2Fleet) for a pool with an "ec2" entry (or none left on
    S3: half-created), counts spelled in instances, a cold run on S3 with --ami, --yes-spend-money
    or --dry-run; else this machine (calque_supervisor.LocalFleet). Only here is calque_ec2
    imported above it.
    A Fleet(conf, backend, args) has (a third fleet is a class of these in one new file, and its
    test in tests/test_fleets.py):
      unit, here, dry_run   what its counts count; whether its workers run this Python; whether
                            it only prints the AWS calls it would make
      create(pool, modal, include, suggested)   `pool create`: the pool (a calque.Pool) and its
                            workers as args.count / args.lo / args.hi ask; re-run: idempotent
      scale(pool, record)   `pool scale`: args.count, or the floor / ceiling args.lo / args.hi
      bounds(record)        (floor, ceiling) of its count, for the planner
      boost(record, count, check=False)   a run was queued: at least `count` (a plan's) while
                            its backlog lasts; check: refuse first what the flags do not allow
      waking(record)        (state, why) for a submit when no worker is live or starting, or None
      status(record)        {queue, dlq, workers, ec2} of `pool status`; lines(status): its own
      logs(record)          `pool logs`; delete(pool, record): `pool delete`, the runs cancelled
      pools()               [{model, record, asg, ...}] of `pool list`
      cold_workers(cold, run, shards, timeout)   a context: fresh workers draining a cold run's
                            queue, yielding what raises WorkersFailed when none is left to
      start_seconds(enter, acquisition)   s from asking for a worker to its first claim
      grant_read(record, uri)   let the pool's workers read an s3:// prefix a run names"""
    if record is not None:
        ec2 = record.get("ec2") or ("queue" not in record and backend.kind == "aws")
    else:
        units = {flag.rpartition("-")[2] for flag in getattr(args, "spelled", {}).values()}
        cold = getattr(args, "verb", None) == "submit" and backend.kind == "aws"
        ec2 = units == {"instances"} or cold and any(
            getattr(args, flag) for flag in ("ami", "yes_spend_money", "dry_run"))
    if ec2:
        import calque_ec2
        return calque_ec2.Ec2Fleet(conf, backend, args)
    return LocalFleet(conf, backend, args)


class FleetCount(argparse.Action):
    """--workers N / --instances N (and --min-*, --max-*): two spellings of one count, in the
    pool's fleet's unit; args.spelled keeps which was given (pool create: --instances is EC2)."""

    def __call__(self, parser, args, value, option):
        try:
            setattr(args, self.dest, int(value))
        except ValueError:
            parser.error(f"argument {option}: invalid int value: {value!r}")
        spelled = getattr(args, "spelled", {})
        if spelled.get(self.dest, option) != option:   # --workers 1 --instances 2: not the last one
            parser.error(f"{spelled[self.dest]} and {option} are one count given twice: give one")
        args.spelled = dict(spelled, **{self.dest: option})


def add_count_flags(parser, helps):
    """pool create's / scale's counts: `helps` for N, A (the floor) and B (the ceiling)."""
    for dest, prefix, metavar, text in zip(("count", "lo", "hi"), ("", "min-", "max-"), "NAB",
                                           helps):
        parser.add_argument(f"--{prefix}workers", f"--{prefix}instances", dest=dest,
                            metavar=metavar, action=FleetCount, help=text)


def check_counts(args, verb):
    """The counts given, in one unit and 0 or more; pool scale: one count, or a floor and/or a
    ceiling (the other kept)."""
    spelled = getattr(args, "spelled", {})
    given = " ".join(f"{flag} {getattr(args, dest)}" for dest, flag in spelled.items())
    if len({flag.rpartition("-")[2] for flag in spelled.values()}) > 1:
        raise UserError(f"{given}: a pool's workers run in one fleet: give its counts in one unit "
                        "---> HINT: --workers for this machine's, --instances for EC2's")
    for dest, flag in spelled.items():
        if getattr(args, dest) < 0:
            raise UserError(f"{flag} {getattr(args, dest)}: must be 0 or more")
    if verb == "scale" and (not spelled or "count" in spelled and len(spelled) > 1):
        raise UserError(f"pool scale {given or 'without a count'}: give --workers N, "
                        f"--instances N, --min-workers A --max-workers B, or --min-instances A "
                        f"--max-instances B ---> HINT: e.g. pool scale --model {args.model} "
                        f"--min-workers 0 --max-workers 2")


# ---- the planner: a run's wall time and cost for 1..B workers before it starts, and after
PLAN_RUNS_READ = 5                      # run records read for the time to a run's first claim
PLAN_CLAIMS_READ = 200                  # claim summaries it reads, over the newest runs (50 a run)
PLAN_MIN_CLAIMS = 10                    # claims that measure a worker count, where another count has them
PLAN_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$")
PLAN_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def claim_sizing(conf, backend, record, claim_size, workers=None):
    """calque_runs.sized_claims over `workers`, by default the pool's ceiling."""
    workers = workers or pool_ceiling(conf, backend, record)[1]
    return sized_claims(conf, backend, record, claim_size, workers)


def parse_duration(text):
    """Seconds of '90', '90s', '20m', '2h', '1.5d'."""
    found = PLAN_DURATION.match(str(text))
    if not found or float(found[1]) <= 0:
        raise UserError(f"--deadline {text!r}: a duration such as 45m, 2h or 90s")
    return float(found[1]) * PLAN_UNITS[found[2]]


def plan_seconds(claim_seconds, starts):
    """The wall time of claims (seconds each, in queue order) on workers free from `starts` (s
    from now): each claim to the worker free first, as workers pull from a queue."""
    free, end = sorted(starts), 0.0
    for seconds in claim_seconds:
        end = max(end, free[0] + seconds)
        heapq.heapreplace(free, free[0] + seconds)
    return end


def pool_ceiling(conf, backend, record):
    """(A, B, noun, running): the pool's floor and ceiling of workers or instances, how many run."""
    stats = mark_lost_workers(read_worker_stats(backend, record["model"]))
    warm = sum(w.get("state") == "running" for w in stats)
    fleet = fleet_for(conf, backend, record)
    return (*fleet.bounds(record), fleet.unit, warm)


def claim_overheads(backend, summaries):
    """(s between a worker's claims, s from a run's creation to its first claim), from these
    summaries (two claims of a worker are consecutive when every claim between them was read; a
    gap over PLAN_GAP_MAX is idle) and their runs' records; 0.0 when unknown."""
    by_worker, gaps, first, read = {}, [], {}, {(s["run_id"], s["claim"]) for s in summaries}
    for summary in summaries:
        started = _parse_time(summary["started_at"], "started_at")
        finished = _parse_time(summary["finished_at"], "finished_at")
        spans = by_worker.setdefault((summary["run_id"], summary["worker_id"]), [])
        spans.append((started, finished, int(summary["claim"][1:])))
        first[summary["run_id"]] = min(first.get(summary["run_id"], started), started)
    for (run_id, _), spans in by_worker.items():
        spans.sort()
        between = ((b[0] - a[1]).total_seconds() for a, b in zip(spans, spans[1:])
                   if all((run_id, claim_id(i)) in read for i in range(a[2] + 1, b[2])))
        gaps += [g for g in between if 0 <= g <= PLAN_GAP_MAX]
    latencies = [(started - _parse_time(read_run(backend, run_id)["created_at"], "created_at"))
                 .total_seconds() for run_id, started in list(first.items())[:PLAN_RUNS_READ]]
    return (statistics.median(gaps) if gaps else 0.0), min(latencies, default=0.0)   # min: warm


def per_item_by_count(summaries):
    """{n: seconds per item} of these summaries (each run's together, as recent_summaries gives them)
    by how many workers ran their run (on shared cores a claim's time depends on it): at each count,
    its newest runs whole, to SCALE_MEASURED_CLAIMS; a count with fewer than PLAN_MIN_CLAIMS (a plan's
    sample claim) only where none has more: it is then scaled from one that has."""
    groups = {}
    for run in (list(run) for _, run in itertools.groupby(summaries, key=lambda s: s["run_id"])):
        group = groups.setdefault(len({s["worker_id"] for s in run}), [])
        group += run if len(group) < SCALE_MEASURED_CLAIMS else []
    enough = {n: group for n, group in groups.items() if len(group) >= PLAN_MIN_CLAIMS} or groups
    return {n: measured_seconds(group)[1] for n, group in enough.items()}


def per_item_at(measured, n, cores):
    """Seconds an item at n workers: as measured at n, else at the nearest count m, times
    max(n, cores) / max(m, cores) (beyond a worker a core, they share the cores)."""
    m = min(measured, key=lambda c: (abs(c - n), -c))
    return measured[m] * max(n, cores) / max(m, cores)


def make_plan(backend, conf, record, items, claim_size, price, summaries):
    """The plan of `items` in claims sized by `claim_size` (ClaimSizes: as submit cuts them, or an
    int): per count 1..B its wall time and cost, from
    measured per-item seconds, overheads and start-up; beside it, cold and serverless."""
    price = choose_pricing(price, summaries)   # the claims it measured: as `cost` prices their runs
    rates, itype = price.rates, price.instance_type
    rate, spot_rate = (instance_rate_per_second(rates, itype, spot=spot) for spot in (False, True))
    measured = per_item_by_count(summaries)
    stats = read_worker_stats(backend, record["model"])
    enter = measured_enter_seconds(stats) or 0.0
    paid = [w["acquisition_seconds"] for w in stats if w.get("acquisition_seconds")]
    acquisition = sum(paid) / len(paid) if paid else 0.0
    _, ceiling, noun, warm = pool_ceiling(conf, backend, record)
    start = fleet_for(conf, backend, record).start_seconds(enter, acquisition)
    gap, latency = claim_overheads(backend, summaries)
    sizes = as_sizes(claim_size).plan(items)
    shared = noun == "workers" and not gpu_devices(conf)     # CPU workers share the cores
    cores = len(os.sched_getaffinity(0)) if shared else math.inf
    options = []
    for n in range(1, ceiling + 1):
        running, per_item = min(n, warm), per_item_at(measured, n, cores)
        claims = [size * per_item + gap for size in sizes]
        # a worker not running yet starts while submit stages (announce_run): the later of the two
        seconds = plan_seconds(claims, [latency] * running + [max(latency, start)] * (n - running))
        options.append({noun: n, "seconds": seconds, "cost_usd": n * seconds * rate,
                        "spot_cost_usd": n * seconds * spot_rate, "starting": n - running,
                        "seconds_per_item": per_item, "measured": n in measured})
    drain = sum(claims)   # cold and serverless counterfactuals: B at once, at B's seconds per item
    cold_acquisition = rates["defaults"]["acquisition_seconds"]["value"]
    return {"model": record["model"], "items": items, "claims": len(claims), "claim_size": max(sizes),
            "claim_sizes": claim_sizes({"claims": sizes, "claim_counts": sizes}),
            "sizing": getattr(claim_size, "why", ""),
            "seconds_per_item": options[-1]["seconds_per_item"], "measured_claims": len(summaries),
            "enter_seconds": enter, "claim_gap_seconds": gap, "first_claim_seconds": latency,
            "start_seconds": start, "running": warm, "noun": noun, "instance_type": itype,
            "priced_as": price.label, "options": options,
            "cold": {noun: ceiling, "seconds": plan_seconds(claims, [cold_acquisition + enter] * ceiling),
                     "cost_usd": (ceiling * (cold_acquisition + enter) + drain) * rate},
            "serverless": {"container": price.serverless, "seconds": plan_seconds(claims, [enter] * ceiling),
                           "cost_usd": (drain + ceiling * enter) * price.serverless_rate}}


def pick_option(plan, deadline=None, budget=None):
    """The option of the fewest workers that meets the deadline (s) and the budget ($), or None."""
    return next((o for o in plan["options"] if (deadline is None or o["seconds"] <= deadline)
                 and (budget is None or o["cost_usd"] <= budget)), None)


def format_plan(plan):
    noun = plan["noun"]
    sizes = plan["claim_sizes"]
    lines = [f"plan: {plan['items']:,} items in {plan['claims']} claim(s) of "
             f"{sizes[0][0] if len(sizes) == 1 else format_sizes(sizes)} "
             f"on pool {plan['model']}: {plan['seconds_per_item'] * 1000:.3g} ms an item (measured "
             f"over {plan['measured_claims']} recent claim(s)), {plan['claim_gap_seconds']:.3g} s "
             f"between claims, first claim after {plan['first_claim_seconds']:.3g} s; "
             f"{plan['running']} {noun} running, a new one starts in {plan['start_seconds']:.3g} s",
             f"  priced as {plan['priced_as']}; claims {plan['sizing'] or 'of a fixed size'}",
             f"  {noun:>9}  {'wall':>10}  {'on-demand':>10}  {'spot':>10}"]
    for o in plan["options"]:
        scaled = "" if o["measured"] else "  (scaled from another count)"
        lines.append(f"  {o[noun]:>9}  {_duration(o['seconds']):>10}  {_usd(o['cost_usd']):>10}  "
                     f"{_usd(o['spot_cost_usd']):>10}{scaled}")
    cold, serverless = plan["cold"], plan["serverless"]
    lines.append(f"  cold start ({cold[noun]} fresh {noun}, each paying acquisition + @enter): "
                 f"{_duration(cold['seconds'])}, {_usd(cold['cost_usd'])}")
    lines.append(f"  serverless ({serverless['container']} per container, {cold[noun]} containers): "
                 f"{_duration(serverless['seconds'])}, {_usd(serverless['cost_usd'])}")
    return lines


def _duration(seconds):
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def plan_against_actual(run, summaries):
    """'predicted X on N workers, actual Y (+d %)' for a finished planned run, naming claims redelivered."""
    plan = run["options"].get("plan")
    if not plan or len(summaries) < len(run["claims"]) or not summaries:
        return None
    ended = max(_parse_time(s["finished_at"], "finished_at") for s in summaries)
    actual = (ended - _parse_time(run["created_at"], "created_at")).total_seconds()
    redelivered = ", ".join(s["claim"] for s in summaries if s["receive_count"] > 1)
    return (f"plan: predicted {_duration(plan['seconds'])} and {_usd(plan['cost_usd'])} on "
            f"{plan['count']} {plan['noun'] if plan['count'] != 1 else plan['noun'][:-1]}; actual "
            f"{_duration(actual)} ({(actual - plan['seconds']) / plan['seconds']:+.0%})" + (redelivered and
            f"; waited out the visibility timeout (a worker died holding it), unpriced by a plan: {redelivered}"))


