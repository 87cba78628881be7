"""Pools that size themselves: desired_count alone, the flags that bound it, the EC2 backlog steps, and a
simulator that drives desired_count through workload profiles on a simulated clock (CPython's sched with an
injected clock), checked for flapping, drain time against the best fixed count, idle cost and the planner."""
import random
import sched
import statistics

import pytest

import calque
import calque_ec2 as ec2
import calque_core
import calque_fleet
TICK = 1.0            # s between two decisions, as the supervisor's SCALE_INTERVAL (coarser: fewer events)
STARTUP = 10.0        # s from spawn to a worker taking claims (acquisition + @enter)
VISIBILITY = 30.0     # s before a dead worker's claim is visible again
IDLE = 60.0           # s idle window
DRAIN = 60.0          # s drain target


def decide(visible, in_flight, current, spc=None, lo=0, hi=4, since=None, now=0.0):
    return calque_core.desired_count(visible, in_flight, current, spc, DRAIN, lo, hi, IDLE, since, now)


def test_desired_count_grows_at_once_and_shrinks_after_the_window():
    assert decide(40, 0, 0).desired == 4                        # unmeasured: one a claim, up to the ceiling
    assert decide(3, 0, 0).desired == 3
    assert decide(100, 0, 1, spc=1.0).desired == 2              # 100 s of work, 60 s target: 2
    assert decide(1, 0, 0, spc=0.01).desired == 1               # any claim wants a worker
    assert decide(0, 0, 0, lo=2).desired == 2                   # the floor holds
    held = decide(0, 0, 3, now=100.0)                           # surplus starts: kept for the window
    assert (held.desired, held.surplus_since) == (3, 100.0)
    assert decide(0, 0, 3, since=100.0, now=159.0).desired == 3
    assert decide(0, 0, 3, since=100.0, now=160.0).desired == 0
    assert decide(0, 2, 3, spc=1.0, since=100.0, now=500.0).desired == 2   # busy workers are not surplus
    assert decide(46, 2, 1, spc=0.34).desired == 1      # one pipelined worker holds two claims: still one
    assert decide(5, 0, 3, since=100.0, now=120.0).surplus_since is None   # work again: the timer resets
    assert "backlog 40+0 in flight, unmeasured" in decide(40, 0, 0).line() and "0 -> 4" in decide(40, 0, 0).line()


def test_pool_bounds_from_the_flags():
    assert calque_core.pool_bounds(3, None, None, None, "workers") == (3, 3, None)          # --workers N: fixed
    assert calque_core.pool_bounds(None, 0, 2, 0.5, "workers") == (0, 2, 30.0)               # fractions of a minute
    assert calque_core.pool_bounds(None, None, 4, None, "workers") == (0, 4, 300.0)          # ceiling alone: floor 0
    assert calque_core.pool_bounds(2, None, None, 10, "workers") == (0, 2, 600.0)            # --workers N + a window
    for bad in ((None, 3, 2, None), (2, None, 3, None), (None, 0, 2, 0), (None, 0, 2, float("nan"))):
        with pytest.raises(calque.UserError, match="---> HINT"):
            calque_core.pool_bounds(*bad, "workers")


def test_backlog_steps_are_desired_count_at_each_threshold():
    assert ec2.backlog_steps(0, 3, None, DRAIN) == [(1, 1), (2, 2), (3, 3)]
    steps = ec2.backlog_steps(1, 8, 15.0, DRAIN)           # one instance drains 4 claims in the target
    assert steps == [(1, 1), (5, 2), (9, 3), (13, 4), (17, 5), (21, 6), (25, 7), (29, 8)]
    for backlog, capacity in steps:
        assert decide(backlog, 0, 0, spc=15.0, lo=1, hi=8).desired == capacity
        assert decide(backlog - 1, 0, 0, spc=15.0, lo=1, hi=8).desired < capacity or backlog == 1
    many = ec2.backlog_steps(0, 100, None, DRAIN)
    assert len(many) <= ec2.STEP_ADJUSTMENTS_MAX and many[-1] == (100, 100)
    assert ec2.backlog_steps(0, 5, 600.0, DRAIN) == [(1, 1)] + [(b, b) for b in range(2, 6)]  # spc > target


class Clock:
    """Simulated time for sched.scheduler: sleep advances it at once."""

    def __init__(self):
        self.now = 0.0

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Sim:
    """A pool on a simulated clock: claims arrive (arrivals: [(time, seconds)]), workers start in STARTUP s,
    take visible claims, and every TICK s desired_count sizes the pool between lo and hi, exactly as the local
    supervisor does: a new worker per missing one, the newest told to stop on scale-in (it finishes its claim
    first, as SIGUSR1 does). kills: times at which a busy worker dies (a spot interruption); its claim is
    visible again VISIBILITY s later."""

    def __init__(self, arrivals, lo, hi, fixed=False, kills=()):
        self.clock = Clock()
        self.s = sched.scheduler(self.clock.time, self.clock.sleep)
        self.lo, self.hi, self.fixed = lo, hi, fixed
        self.visible, self.in_flight, self.done = [], 0, []
        self.workers, self.next_id, self.since = {}, 0, None
        self.alive_seconds, self.history, self.redelivered = 0.0, [], 0
        self.total = len(arrivals)
        for t, seconds in arrivals:
            self.s.enterabs(t, 1, self.arrive, (seconds,))
        for t in kills:
            self.s.enterabs(t, 0, self.kill)
        if fixed:
            for _ in range(hi):
                self.spawn()
        self.s.enterabs(0.0, 2, self.tick)

    def now(self):
        return self.clock.time()

    def arrive(self, seconds):
        self.visible.append(seconds)
        self.dispatch()

    def spawn(self):
        self.next_id += 1
        self.workers[self.next_id] = {"state": "starting", "since": self.now(), "stop": False}
        self.s.enter(STARTUP, 1, self.ready, (self.next_id,))

    def ready(self, wid):
        if wid in self.workers:
            self.workers[wid]["state"] = "idle"
            self.dispatch()

    def dispatch(self):
        for wid, w in sorted(self.workers.items()):
            if w["state"] == "idle" and self.visible:
                seconds = self.visible.pop(0)
                w.update(state="busy", claim=seconds)
                self.in_flight += 1
                w["event"] = self.s.enter(seconds, 1, self.finish, (wid, seconds))

    def finish(self, wid, seconds):
        self.in_flight -= 1
        self.done.append((self.now(), seconds))
        self.workers[wid]["state"] = "idle"
        if self.workers[wid]["stop"]:
            self.exit(wid)
        self.dispatch()

    def exit(self, wid):
        self.alive_seconds += self.now() - self.workers.pop(wid)["since"]

    def kill(self):
        busy = [wid for wid, w in self.workers.items() if w["state"] == "busy"]
        if busy:
            w = self.workers[busy[0]]
            self.s.cancel(w["event"])
            self.exit(busy[0])
            self.redelivered += 1
            self.s.enter(VISIBILITY, 1, self.redeliver, (w["claim"],))

    def redeliver(self, seconds):
        self.in_flight -= 1
        self.arrive(seconds)

    def tick(self):
        live = [wid for wid, w in self.workers.items() if not w["stop"]]
        if not self.fixed:
            # as recent_summaries: claims spread over the whole run so far
            step = max(1, len(self.done) // calque_core.SCALE_MEASURED_CLAIMS)
            recent = [seconds for _, seconds in self.done[::step]]
            spc = statistics.mean(recent) if recent else None
            scale = calque_core.desired_count(len(self.visible), self.in_flight, len(live), spc, DRAIN, self.lo, self.hi,
                                         IDLE, self.since, self.now())
            self.since = scale.surplus_since
            if scale.desired != len(live):
                self.history.append((self.now(), scale.desired))
            for _ in range(scale.desired - len(live)):
                self.spawn()
            for wid in sorted(live, reverse=True)[:max(0, len(live) - scale.desired)]:
                self.workers[wid]["stop"] = True
                if self.workers[wid]["state"] != "busy":
                    self.exit(wid)
        elif len(live) < self.hi:
            self.spawn()                           # a fixed pool replaces a dead worker too
        if len(self.done) < self.total or self.workers and not self.fixed:
            self.s.enter(TICK, 2, self.tick)

    def run(self):
        self.s.run()
        for wid in list(self.workers):
            self.exit(wid)
        return self

    @property
    def drained_at(self):
        return max(t for t, _ in self.done)


def jittered(n, seconds, spread, seed, start=0.0, every=0.0):
    rng = random.Random(seed)
    return [(start + i * every, seconds * rng.uniform(1 - spread, 1 + spread)) for i in range(n)]


def reversals(history, window):
    """Times the desired count went down and then up again (or up then down) within `window` s: flapping."""
    flaps = 0
    for (t0, a), (t1, b), (t2, c) in zip(history, history[1:], history[2:]):
        if (b - a) * (c - b) < 0 and t2 - t1 < window:
            flaps += 1
    return flaps


def best_fixed(arrivals, hi):
    return min(Sim(arrivals, n, n, fixed=True).run().drained_at for n in range(1, hi + 1))


def test_burst_drains_near_the_best_fixed_count_and_idles_within_the_window():
    arrivals = jittered(40, 5.0, 0.2, seed=1)
    sim = Sim(arrivals, 0, 4).run()
    assert len(sim.done) == 40 and sim.redelivered == 0
    assert sim.drained_at <= 1.2 * best_fixed(arrivals, 4)
    assert [d for _, d in sim.history] == [4, 0]                      # up once, down once
    assert sim.history[-1][0] - sim.drained_at <= IDLE + 2 * TICK     # back to 0 within the window
    busy = sum(seconds for _, seconds in sim.done)
    assert sim.alive_seconds - busy <= 4 * (IDLE + STARTUP + 2 * TICK) + 4 * 5.0 * 1.2   # idle cost: the window


def test_steady_stream_does_not_flap():
    arrivals = jittered(300, 5.0, 0.3, seed=2, every=2.0)            # needs 2.5 workers on average
    sim = Sim(arrivals, 0, 6).run()
    assert len(sim.done) == 300
    assert reversals(sim.history, IDLE) == 0
    assert len(sim.history) <= 12, sim.history
    waits = max(t - (i * 2.0) for i, (t, _) in enumerate(sorted(sim.done)))
    assert waits <= DRAIN + STARTUP + 3 * 5.0 * 1.3                 # a claim waits about the drain target at most


def test_long_tail_keeps_busy_workers_and_sheds_idle_ones():
    rng = random.Random(3)
    arrivals = [(0.0, 120.0 if rng.random() < 0.1 else 5.0) for _ in range(40)]
    sim = Sim(arrivals, 0, 4).run()
    assert len(sim.done) == 40 and sim.redelivered == 0
    assert reversals(sim.history, IDLE) == 0
    assert sim.drained_at <= 1.2 * best_fixed(arrivals, 4)


def test_spot_interruption_is_replaced_and_redelivered_once():
    arrivals = jittered(40, 5.0, 0.2, seed=4)
    sim = Sim(arrivals, 0, 4, kills=(20.0,)).run()
    assert len(sim.done) == 40 and sim.redelivered == 1
    assert max(d for _, d in sim.history) == 4 and sim.history.count((20.0, 4)) <= 1
    assert sim.drained_at <= 1.2 * best_fixed(arrivals, 4) + VISIBILITY


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_planner_within_15_percent_of_the_simulated_run(workers):
    """make_plan's wall time (plan_seconds at the measured mean per item) against a fixed pool's simulated run
    whose claims vary +-30 %."""
    arrivals = jittered(40, 5.0, 0.3, seed=5 + workers)
    measured = statistics.mean(seconds for _, seconds in jittered(50, 5.0, 0.3, seed=99))   # recent summaries
    predicted = calque_fleet.plan_seconds([measured] * 40, [STARTUP] * workers)
    actual = Sim(arrivals, workers, workers, fixed=True).run().drained_at
    assert abs(predicted - actual) / actual <= 0.15, (predicted, actual)


def test_planner_measures_each_count_on_whole_runs(tmp_path):
    """A 40-claim run at 1 worker, then a 300-claim run at 4 whose first 100 claims ran at half speed (submit
    staging beside them): the 4-worker figure is that run's whole average, not its first claims', the 1-worker
    run is not crowded out by the bigger one, the reads are a sample, not 340, and the gap between a worker's
    claims is measured on consecutive ones only (those of a sample's stretches)."""
    backend = calque_core.LocalBackend(str(tmp_path))
    for run_id, workers, claims in (("m.20261201-000000-aaaaaa", 1, 40), ("m.20261202-000000-bbbbbb", 4, 300)):
        calque_core.write_json(backend, calque_core.run_key(run_id), {"created_at": calque_core.now_iso(999.0 * workers),
                                                            "claims": [calque_core.claim_id(i) for i in range(claims)]})
        free = [1000.0 * workers] * workers                 # when each worker takes its next claim
        for i in range(claims):
            seconds, worker = (0.02 if workers == 4 and i < 100 else 0.01), i % workers
            calque_core.write_json(backend, calque_core.summary_key(run_id, calque_core.claim_id(i)), {
                "run_id": run_id, "claim": calque_core.claim_id(i), "worker_id": f"w{worker}", "mode": "pool",
                "items": 10, "claim_seconds": seconds, "started_at": calque_core.now_iso(free[worker]),
                "finished_at": calque_core.now_iso(free[worker] + seconds)})
            free[worker] += seconds + 0.003                 # 3 ms between a worker's claims
    gets = backend.requests["store_gets"]
    summaries = calque_core.recent_summaries(backend, "m", calque_fleet.PLAN_CLAIMS_READ)
    measured = calque_fleet.per_item_by_count(summaries)
    assert backend.requests["store_gets"] - gets == calque_core.SCALE_MEASURED_CLAIMS + 40
    assert measured[1] == pytest.approx(0.001)
    assert measured[4] == pytest.approx((100 * 0.02 + 200 * 0.01) / (300 * 10), rel=0.1)   # 0.002: its first claims
    stretches = [s for s in summaries if s["run_id"].endswith("bbbbbb")]
    assert calque_fleet.claim_overheads(backend, stretches)[0] == pytest.approx(0.003)
    sample = [dict(summaries[-1], run_id="m.20261130-000000-cccccc", claim_seconds=1.0)]   # a slow sample claim
    assert set(calque_fleet.per_item_by_count(stretches + sample)) == {4}       # 1 worker: scaled from the 50 claims
    assert calque_fleet.per_item_by_count(sample) == {1: 0.1}                    # where it is all there is


def test_plan_seconds_and_pick():
    assert calque_fleet.plan_seconds([1.0] * 10, [0.0, 0.0]) == 5.0
    assert calque_fleet.plan_seconds([1.0] * 3, [0.0, 10.0]) == 3.0        # a slow starter takes nothing
    plan = {"options": [{"workers": n, "seconds": 100.0 / n, "cost_usd": 1.0 + n} for n in (1, 2, 3, 4)]}
    assert calque_fleet.pick_option(plan, deadline=40.0)["workers"] == 3
    assert calque_fleet.pick_option(plan, budget=3.5)["workers"] == 1
    assert calque_fleet.pick_option(plan, deadline=40.0, budget=3.5) is None
    assert calque_fleet.parse_duration("2h") == 7200 and calque_fleet.parse_duration("90") == 90
    with pytest.raises(calque.UserError, match="--deadline"):
        calque_fleet.parse_duration("soon")


def test_predicted_against_actual_names_the_claims_that_waited_out_a_dead_worker():
    run = {"options": {"plan": {"seconds": 10.0, "cost_usd": 0.01, "count": 1, "noun": "workers"}},
           "claims": ["c00000", "c00001"], "created_at": "2026-12-02T08:00:00.000+00:00"}
    done = [{"claim": "c00000", "receive_count": 1, "finished_at": "2026-12-02T08:00:05.000+00:00"},
            {"claim": "c00001", "receive_count": 2, "finished_at": "2026-12-02T08:01:10.000+00:00"}]
    line = calque_fleet.plan_against_actual(run, done)
    assert line.startswith("plan: predicted 10.0 s and $0.01 on 1 worker; actual 70.0 s (+600%); waited out"), line
    assert line.endswith("unpriced by a plan: c00001")
    assert calque_fleet.plan_against_actual(run, [done[0], dict(done[1], receive_count=1)]).endswith("(+600%)")
    assert calque_fleet.plan_against_actual(run, done[:1]) is None                # not finished yet
