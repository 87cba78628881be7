"""make bench, part 4: a real model job, and table input at scale.

    .venv/bin/python bench/bench_embed.py                 # both sections
    BENCH_EMBED_ITEMS=2000 .venv/bin/python bench/bench_embed.py embed
    .venv/bin/python bench/bench_embed.py parquet

1. parquet: a BENCH_PARQUET_ROWS-row Parquet file of such texts (pyarrow's default row groups: one of 1M rows),
   and the same rows as JSONL, submitted to a warm pool of one plain-Python worker: the submit process's peak RSS
   (getrusage) and the time from its start to the first claim received (the first summary's start).
2. embed: examples/embed_model.py (a 4 x 256 BERT with random weights, built by examples/make_embed_model.py)
   over BENCH_EMBED_ITEMS texts of 5-120 words in a Parquet file, end to end (texts read, embeddings written to
   an .npy file): a plain one-process loop (the limit: the handler's own methods, batches of 32, torch's default
   threads) against calque with 1 and 2 local workers on default settings (submit to a warm pool, then `runs
   results --format npy`; claims sized to the run), 2 workers with claims of CLAIM (this bench's size before
   claims were sized to the run), and 2 workers each taking every core (--threads-per-worker = cores: calque before it
   shared them); items/s, the ratio to the loop, the embeddings' largest difference from the loop's, the bytes the
   run stored per item (all of it, and its result parts alone) against the 1,024 raw bytes of a 256-float32 row;
3. redelivery: one claim of REDELIVERED texts on one warm worker, whole, then again with the worker killed -9
   halfway: the redelivery's seconds an item (it runs alone only the two batches the spool says the death could
   be in, then batches) against the whole claim's.
The machine is shared and noisy: read the ratios measured side by side, not the absolutes.
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import chosen, compile_kit  # noqa: E402

# ------------------------------------------------------------------------------------------------
EMBED_ITEMS = int(os.environ.get("BENCH_EMBED_ITEMS", "10000"))  # texts of the job (~70 s a run here): a run
# of 2,000 (13 s) is a tenth start-up: the two CLI starts, the first claim, the last claim's tail
PARQUET_ROWS = int(os.environ.get("BENCH_PARQUET_ROWS", "1000000"))     # rows of the staging section's file
UNIQUE_TEXTS = 100_000            # distinct texts in that file (repeated to its size: generating is slow)
BATCH = 32                        # items per handler call, in the loop and the pools (calque's default)
CLAIM = 250                       # the claim size this bench gave before claims were sized to the run, side by side
RAW_ROW = 256 * 4                 # bytes of one embedding as float32
SECTIONS = ("embed", "parquet", "redelivery")
REDELIVERED = 1280                # texts of the redelivery section's one claim
HANDLER = os.path.join(ROOT, "examples", "embed_model.py") + ":EmbedModel"
PLAIN = os.path.join(ROOT, "tests", "handlers.py") + ":Empty"
PY = sys.executable
# the staging section's files: UNIQUE_TEXTS texts repeated to PARQUET_ROWS rows, as Parquet and as JSONL
GENERATE = """
import json, os, sys
sys.path.insert(0, {examples!r})
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, make_embed_model
rows = np.resize(np.array(make_embed_model.texts({unique}), dtype=object), {rows})
pq.write_table(pa.table({{"id": np.arange({rows}), "text": rows}}), os.path.join(sys.argv[1], "rows.parquet"))
with open(os.path.join(sys.argv[1], "rows.jsonl"), "w") as f:
    f.writelines(json.dumps({{"id": i, "text": t}}) + "\\n" for i, t in enumerate(rows))
with open(os.path.join(sys.argv[1], "row-groups"), "w") as f:
    f.write(str(pq.ParquetFile(os.path.join(sys.argv[1], "rows.parquet")).metadata.num_row_groups))
""".format(examples=os.path.join(ROOT, "examples"), unique=min(UNIQUE_TEXTS, PARQUET_ROWS), rows=PARQUET_ROWS)
# the plain loop: the handler loaded, then the clock runs over reading the texts, the batches and writing the .npy
LOOP = """
import sys, time
sys.path.insert(0, {examples!r})
import numpy as np, pyarrow.parquet as pq, torch
from embed_model import EmbedModel
model = EmbedModel()
model.load()
t0 = time.perf_counter()
items = [{{"text": t}} for t in pq.read_table(sys.argv[1], columns=["text"]).column("text").to_pylist()]
np.save(sys.argv[2], np.concatenate([model.embed(items[i:i + {batch}]).numpy() for i in range(0, len(items), {batch})]))
print(time.perf_counter() - t0, torch.get_num_threads())
""".format(examples=os.path.join(ROOT, "examples"), batch=BATCH)


def calque_cli(env, *args, cwd=None):
    out = subprocess.run([PY, os.path.join(ROOT, "calque.py"), *args], env=env, cwd=cwd or env["BENCH_DIR"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def pool_env(tmp, folder):
    """The environment of a pool whose store and state are in `folder`, on the model built in `tmp`."""
    return dict(os.environ, CALQUE_STORE=os.path.join(folder, "store"), CALQUE_STATE=os.path.join(folder, "state"),
                BENCH_DIR=tmp, EMBED_MODEL_DIR=os.path.join(tmp, "embed-model"), HF_HUB_OFFLINE="1")


def make_texts(tmp, count, name):
    """The random-weight model in tmp/embed-model and `count` texts in tmp/`name` (a Parquet file): its path."""
    texts = os.path.join(tmp, name)
    subprocess.run([PY, os.path.join(ROOT, "examples", "make_embed_model.py"), os.path.join(tmp, "embed-model"),
                    "--texts", str(count), texts], check=True, capture_output=True)
    return texts


def calque_run(tmp, texts, workers, *extra, claim=()):
    """A warm pool of `workers` (`extra`: pool create flags), then submit (`claim`: its flags) + `runs results
    --format npy`, timed; (s, embeddings, bytes stored per item, result-part bytes per item, claim sizes)."""
    import numpy as np
    folder = os.path.join(tmp, f"pool-{workers}{'-'.join(extra)}")
    env = pool_env(tmp, folder)
    calque_cli(env, "pool", "create", "--model", "embed", "--handler", HANDLER, "--workers", str(workers), *extra)
    try:
        out = os.path.join(folder, "emb.npy")
        t0 = time.perf_counter()
        run_id = calque_cli(env, "submit", "--pool", "embed", texts, "--columns", "text", *claim).split()[1]
        calque_cli(env, "runs", "results", run_id, "--format", "npy", "--output", out)
        seconds = time.perf_counter() - t0
        run_dir = os.path.join(env["CALQUE_STORE"], "runs", run_id)
        sizes = next(line for line in calque_cli(env, "runs", "show", run_id).splitlines() if "claim sizes" in line)
        return (seconds, np.load(out), folder_bytes(run_dir) / EMBED_ITEMS,
                folder_bytes(os.path.join(run_dir, "results")) / EMBED_ITEMS, sizes.split("(")[0].split(":")[1])
    finally:
        calque_cli(env, "pool", "delete", "--model", "embed", "--yes")


def embed_section(tmp):
    import numpy as np
    texts = make_texts(tmp, EMBED_ITEMS, "texts.parquet")
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ, EMBED_MODEL_DIR=os.path.join(tmp, "embed-model"), HF_HUB_OFFLINE="1")
    out = subprocess.run([PY, "-c", LOOP, texts, os.path.join(tmp, "loop.npy")], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    seconds, threads = out.stdout.split()
    loop_rate, want = EMBED_ITEMS / float(seconds), np.load(os.path.join(tmp, "loop.npy"))
    print(f"   plain loop, one process ({threads} torch threads)   {loop_rate:7.1f} items/s   1.00x")
    claim = ("--claim-size", str(CLAIM))
    for workers, extra, name, given in ((1, (), "1 worker, defaults", ()), (2, (), "2 workers, defaults", ()),
                                        (2, (), f"2 workers, claims of {CLAIM}", claim),
                                        (2, ("--threads-per-worker", str(cores)), f"2 workers x {cores} threads", ())):
        seconds, got, stored, parts, sizes = calque_run(tmp, texts, workers, *extra, claim=given)
        rate = EMBED_ITEMS / seconds
        print(f"   calque, {name:<28} {rate:7.1f} items/s   {rate / loop_rate:4.2f}x   "
              f"max |diff| {np.abs(got - want).max():.1e}   stored {stored:,.0f} B an item "
              f"({stored / RAW_ROW:.2f}x raw; result parts {parts:,.0f} B, {parts / RAW_ROW:.2f}x); claims{sizes}")


def redelivery_section(tmp):
    texts = make_texts(tmp, REDELIVERED, "redelivered.parquet")
    env = pool_env(tmp, os.path.join(tmp, "redelivery"))
    calque_cli(env, "pool", "create", "--model", "embed", "--handler", HANDLER, "--workers", "1",
               "--visibility-timeout", "3")
    status = os.path.join(env["CALQUE_STATE"], "pools", "embed", "supervisor.json")

    def claim(kill_after=None):
        """The run's one summary; with `kill_after`, its worker killed -9 that many seconds in."""
        submit = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "embed", texts,
                                   "--columns", "text", "--claim-size", str(REDELIVERED), "--json"],
                                  env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if kill_after:
            time.sleep(kill_after)
            with open(status) as f:
                os.kill(json.load(f)["workers"][0]["pid"], 9)
        return json.loads(submit.communicate()[0])["summaries"][0]

    try:
        claim()   # the worker warm, its first claim paid
        whole = claim()["claim_seconds"] / REDELIVERED
        again = claim(kill_after=whole * REDELIVERED / 2)
        rest = REDELIVERED - again["resumed"]
        print(f"   whole claim {whole * 1e3:.2f} ms an item; redelivered (delivery {again['receive_count']}) "
              f"{rest} items at {again['claim_seconds'] / rest * 1e3:.2f} ms: "
              f"{again['claim_seconds'] / rest / whole:.2f}x")
    finally:
        calque_cli(env, "pool", "delete", "--model", "embed", "--yes", "--force")


def submit_measured(env, path):
    """submit --pool of `path`, as a child: (peak RSS MiB, s from its start to the first claim received)."""
    started = time.time()
    proc = subprocess.Popen([PY, os.path.join(ROOT, "calque.py"), "submit", "--pool", "plain", path, "--json"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    first = min(datetime.datetime.fromisoformat(s["started_at"]).timestamp()
                for s in json.loads(stdout)["summaries"])
    return usage.ru_maxrss / 1024, first - started


def parquet_section(tmp):
    """(Run first: this process still holds no numpy or pyarrow, whose pages a forked child's peak RSS would
    count before it execs.)"""
    subprocess.run([PY, "-c", GENERATE, tmp], check=True)
    with open(os.path.join(tmp, "row-groups")) as f:
        groups = f.read()
    env = dict(os.environ, CALQUE_STORE=os.path.join(tmp, "plain", "store"),
               CALQUE_STATE=os.path.join(tmp, "plain", "state"), BENCH_DIR=tmp)
    calque_cli(env, "pool", "create", "--model", "plain", "--handler", PLAIN, "--workers", "1")
    try:
        for name in ("rows.parquet", "rows.jsonl"):
            rss, first = submit_measured(env, os.path.join(tmp, name))
            print(f"   {PARQUET_ROWS:,} rows, {name:<13} ({os.path.getsize(os.path.join(tmp, name)) / 2**20:,.0f} MiB"
                  f"{f', {groups} row group(s)' if name.endswith('parquet') else ''}): submit peak RSS {rss:5.0f} MiB,"
                  f" first claim {first:4.2f} s after submit started")
    finally:
        calque_cli(env, "pool", "delete", "--model", "plain", "--yes")


def main():
    sections = chosen(SECTIONS)
    compile_kit()
    tmp = tempfile.mkdtemp(prefix="calque-bench-embed-")
    print(f"calque bench, a real model  ({len(os.sched_getaffinity(0))} cores, python {sys.version.split()[0]})")
    if "parquet" in sections:   # first: see parquet_section
        print(f"\n1. submitting {PARQUET_ROWS:,} rows to a warm pool of one plain-Python worker")
        parquet_section(tmp)
    if "embed" in sections:
        print(f"\n2. embeddings of {EMBED_ITEMS:,} texts (4 x 256 BERT, batches of {BATCH}, claims sized to the run "
              f"on defaults), end to end")
        embed_section(tmp)
    if "redelivery" in sections:
        print(f"\n3. a claim of {REDELIVERED:,} texts redelivered after a kill -9 halfway, against the same whole")
        redelivery_section(tmp)


if __name__ == "__main__":
    main()
