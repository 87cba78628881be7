"""Cost model: hand-computed arithmetic, the crossover ladder, pool idle budget, bad rates files.

Most cases use a small rates file with round numbers (an instance at $3.60/h = $0.001/s) so the
arithmetic in the comments can be checked by hand.
"""
import copy
import os
import json
import math
import re
from pathlib import Path

import pytest

# The one import of the code under test (becomes `from calque import ...` when merged).
from calque_cost import (_pair, _span_reason, _usd, claim_cost, crossover_ladder, format_ladder,
                         format_pool_cost, format_run_cost, instance_rate_per_second, load_rates,
                         measured_enter_seconds, pool_cost, price_label, request_cost, run_cost,
                         serverless_rate_per_second, serverless_stand_in)
from calque import UserError

REPO_RATES = Path(__file__).resolve().parent.parent / "rates.json"
SRC = {"source": "test", "as_of": "2026-11-29"}
RATES = {
    "version": 1,
    "updated": "2026-11-29",
    "ec2": {
        "instances": {"t.gpu": {"usd_per_hour": 3.6, "gpu": "X1", "gpus": 1, "serverless_card": "X1", **SRC}},
        "spot_fraction": {"value": 0.5, **SRC},
        "savings_plan_fraction": {"value": 0.75, **SRC},
    },
    "serverless": {
        "gpu_rate_includes_cpu_memory": False,
        "cards": {"X1": {"usd_per_second": 0.002, **SRC}},
        "cpu_usd_per_core_second": {"value": 0.0001, **SRC},
        "memory_usd_per_gib_second": {"value": 0.00001, **SRC},
        "container_per_gpu": {"cpu_cores": 2, "memory_gib": 10},
    },
    "requests": {
        "sqs_usd_per_million": {"value": 0.40, **SRC},
        "s3_put_usd_per_thousand": {"value": 0.005, **SRC},
        "s3_get_usd_per_thousand": {"value": 0.0004, **SRC},
    },
    "defaults": {"instance_type": {"value": "t.gpu"}, "acquisition_seconds": {"value": 90}},
}
R_INST = 0.001  # $/s of t.gpu: 3.6 / 3600


def write_rates(tmp_path, rates=RATES):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(rates))
    return path


@pytest.fixture
def rates(tmp_path):
    return load_rates(write_rates(tmp_path))


def summary(claim=0, items=100, ok=None, enter=0.0, claim_seconds=20.0, acquisition=0.0, requests=None):
    return {"run_id": "r1", "claim": claim, "items": items, "ok": items if ok is None else ok, "failed": [],
            "warm_hit": enter == 0.0, "enter_seconds_paid": enter, "claim_seconds": claim_seconds,
            "acquisition_seconds": acquisition, "requests": requests or {}}


def stats(alive=1000.0, busy=500.0, enter=100.0, claims=10, items=1000, worker_id="w1",
          started="2026-11-29T09:00:00Z", updated="2026-11-29T10:00:00Z", requests=None):
    return {"worker_id": worker_id, "alive_seconds": alive, "busy_seconds": busy, "claims": claims,
            "warm_hits": claims - 1, "enter_count": 1, "enter_seconds": enter, "items": items,
            "requests": requests or {}, "started_at": started, "updated_at": updated}


# ---- the shipped rates file ----

def test_shipped_rates_file_validates_and_covers_the_issue():
    """rates.json loads, and names the instance types and serverless cards the issue asks for."""
    rates = load_rates(REPO_RATES)
    for t in ("g4dn.xlarge", "g4dn.2xlarge", "g4dn.12xlarge", "g5.xlarge", "g5.2xlarge", "g5.12xlarge",
              "g5.48xlarge", "g6.xlarge", "g6.2xlarge", "g6.12xlarge", "g6e.xlarge", "g6e.2xlarge",
              "g6e.12xlarge", "p4d.24xlarge", "p5.48xlarge"):
        assert instance_rate_per_second(rates, t) > 0
    for card in ("T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100", "H200"):
        assert serverless_rate_per_second(rates, card) > 0
    assert rates["defaults"]["instance_type"]["status"] == "assumed"
    assert rates["defaults"]["acquisition_seconds"]["status"] == "assumed"


def test_shipped_g5_xlarge_matches_its_published_price():
    """g5.xlarge is $1.006/h; its serverless stand-in is one A10G plus a container's CPU and memory."""
    rates = load_rates(REPO_RATES)
    assert instance_rate_per_second(rates, "g5.xlarge") * 3600 == pytest.approx(1.006)
    assert serverless_stand_in(rates, "g5.xlarge")[1] == "1x A10G"
    # 0.000306 GPU + 2 cores * 0.0000131 + 16 GiB * 0.00000222 = 0.00036772 $/s
    assert serverless_rate_per_second(rates, "A10G") == pytest.approx(0.00036772)


# ---- rates ----

def test_instance_rate_on_demand_spot_and_savings_plan(rates):
    """$3.60/h is $0.001/s on demand, x0.5 spot, x0.75 under a savings plan; not both at once."""
    assert instance_rate_per_second(rates, "t.gpu") == pytest.approx(0.001)
    assert instance_rate_per_second(rates, "t.gpu", spot=True) == pytest.approx(0.0005)
    assert instance_rate_per_second(rates, "t.gpu", savings_plan=True) == pytest.approx(0.00075)
    with pytest.raises(UserError):
        instance_rate_per_second(rates, "t.gpu", spot=True, savings_plan=True)


def test_unknown_instance_type_lists_known_ones(rates):
    """An instance type without a rate is a UserError listing the types that have one."""
    with pytest.raises(UserError, match=r"'g9\.huge'.*known: t\.gpu"):
        instance_rate_per_second(rates, "g9.huge")


def test_serverless_rate_adds_container_cpu_and_memory(rates):
    """Per GPU: 0.002 + 2 cores * 0.0001 + 10 GiB * 0.00001 = 0.0023 $/s; two GPUs double it."""
    assert serverless_rate_per_second(rates, "X1") == pytest.approx(0.0023)
    assert serverless_rate_per_second(rates, "x1", count=2) == pytest.approx(0.0046)


def test_serverless_rate_that_includes_cpu_memory_is_the_card_rate(tmp_path):
    """When the file says the GPU rate already includes CPU and memory, nothing is added."""
    r = copy.deepcopy(RATES)
    r["serverless"]["gpu_rate_includes_cpu_memory"] = True
    assert serverless_rate_per_second(load_rates(write_rates(tmp_path, r)), "X1") == pytest.approx(0.002)


def test_unknown_serverless_card_lists_known_ones(rates):
    """An unknown card is a UserError listing the cards that have a rate."""
    with pytest.raises(UserError, match=r"'Z9'.*known: X1"):
        serverless_rate_per_second(rates, "Z9")


def test_price_label_names_instance_option_and_rate(rates):
    """The label every report is 'priced as' carries type, GPUs, purchase option and $/h."""
    assert price_label(rates, "t.gpu", spot=True).startswith("t.gpu (1x X1) spot $1.80/h")


# ---- requests ----

def test_request_cost_counts_every_kind(rates):
    """SQS: (10 + 30 empty + 60) * $0.40/M = $0.00004; S3: 1000 GET * $0.0004/k = $0.0004,
    (500 PUT + 500 LIST) * $0.005/k = $0.005; total $0.00544."""
    n = {"queue_receives": 10, "queue_empty_receives": 30, "queue_other": 60,
         "store_gets": 1000, "store_puts": 500, "store_lists": 500}
    assert request_cost(rates, n) == pytest.approx(0.00544)


def test_empty_long_polls_are_billed(rates):
    """A million empty receives (an idle worker long-polling) cost $0.40."""
    assert request_cost(rates, {"queue_empty_receives": 1_000_000}) == pytest.approx(0.40)


def test_request_counters_missing_are_zero_and_unknown_are_refused(rates):
    """An absent counter prices as 0; a misspelt one fails loudly instead of going unpriced."""
    assert request_cost(rates, {}) == 0
    assert request_cost(rates, None) == 0
    with pytest.raises(ValueError, match="queue_recieves"):
        request_cost(rates, {"queue_recieves": 3})
    with pytest.raises(ValueError):
        request_cost(rates, {"store_gets": -1})


# ---- per claim ----

def test_warm_claim_is_all_variable(rates):
    """Warm hit: no @enter, no acquisition; 20 s at $0.001/s = $0.02 variable, $0 fixed."""
    c = claim_cost(summary(enter=0.0, claim_seconds=20.0), R_INST, rates)
    assert (c["fixed_seconds"], c["variable_seconds"]) == (0.0, 20.0)
    assert c["fixed_usd"] == 0
    assert c["variable_usd"] == pytest.approx(0.02)
    assert c["total_usd"] == pytest.approx(0.02)


def test_cold_claim_splits_fixed_and_variable(rates):
    """Cold: fixed = 30 s @enter + 90 s acquisition = 120 s ($0.12); variable = 50 - 30 = 20 s ($0.02);
    requests 2 GETs + 1 PUT = $0.0000008 + $0.000005; total $0.1400058."""
    s = summary(enter=30.0, claim_seconds=50.0, acquisition=90.0, requests={"store_gets": 2, "store_puts": 1})
    c = claim_cost(s, R_INST, rates)
    assert (c["fixed_seconds"], c["variable_seconds"], c["instance_seconds"]) == (120.0, 20.0, 140.0)
    assert c["fixed_usd"] == pytest.approx(0.12)
    assert c["variable_usd"] == pytest.approx(0.02)
    assert c["request_usd"] == pytest.approx(0.0000058)
    assert c["total_usd"] == pytest.approx(0.1400058)


def test_variable_seconds_never_negative(rates):
    """A claim timed a hair shorter than its @enter (clocks read apart) has 0 variable seconds."""
    assert claim_cost(summary(enter=30.0, claim_seconds=29.9), R_INST, rates)["variable_seconds"] == 0.0


def test_malformed_summary_names_the_claim_and_field(rates):
    """A summary without claim_seconds is a UserError naming the claim and the field."""
    s = summary(claim=7)
    del s["claim_seconds"]
    with pytest.raises(UserError, match=r"claim 7 of run r1.*'claim_seconds'"):
        claim_cost(s, R_INST, rates)


# ---- per run ----

def test_pool_run_against_its_cold_counterfactual(rates):
    """Two warm claims of 20 s and 30 s, 100 items each: actual 50 s = $0.05, $0.25 per 1,000 items.
    Cold = one acquisition: (90 + 30 + 50) s = $0.17; saving $0.12 = 70.59%."""
    r = run_cost([summary(0, claim_seconds=20.0), summary(1, claim_seconds=30.0)], R_INST, rates,
                 enter_seconds=30.0, acquisition_seconds=90.0)
    assert r["total_usd"] == pytest.approx(0.05)
    assert r["usd_per_1000_items"] == pytest.approx(0.25)
    assert r["seconds_per_item"] == pytest.approx(0.25)
    assert r["cold"]["instance_seconds"] == pytest.approx(170.0)
    assert r["cold"]["usd"] == pytest.approx(0.17)
    assert r["saving_usd"] == pytest.approx(0.12)
    assert r["saving_fraction"] == pytest.approx(0.12 / 0.17)
    assert r["warm_hits"] == 2 and not r["partial"]
    assert r["inputs"]["@enter seconds"] == "measured" and r["inputs"]["acquisition seconds"] == "assumed"


def test_first_claim_paying_enter_saves_only_acquisition(rates):
    """A pool's first claim paid @enter 30 s inside its 50 s: actual 50 s, cold 90 + 30 + 20 = 140 s;
    the pool saved the 90 s acquisition only: $0.09."""
    r = run_cost([summary(enter=30.0, claim_seconds=50.0)], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0)
    assert r["saving_usd"] == pytest.approx(0.09)


def test_cold_run_is_its_own_baseline(rates):
    """A cold run (acquisition 90 + @enter 30 + drain 50) costs what its counterfactual costs: saving 0;
    the same work on a warm pool is the 50 s drain, $0.05."""
    r = run_cost([summary(enter=30.0, claim_seconds=80.0, acquisition=90.0)], R_INST, rates,
                 enter_seconds=30.0, acquisition_seconds=90.0, acquisition_status="measured")
    assert r["total_usd"] == pytest.approx(0.17)
    assert r["saving_usd"] == pytest.approx(0.0)
    assert r["warm_usd"] == pytest.approx(0.05)


def test_sharded_cold_counterfactual_pays_per_shard(rates):
    """Cold with 3 shards pays 3 x (90 + 30) = 360 s plus the 20 s drain: $0.38."""
    r = run_cost([summary()], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0, shards=3)
    assert r["cold"]["usd"] == pytest.approx(0.38)


def test_run_requests_are_summed_and_labelled_by_backend(rates):
    """Claims' counts add up; a local run's request $ are 'as if' on SQS + S3, and it says so."""
    a = summary(0, requests={"queue_receives": 1, "queue_other": 3, "store_gets": 2})
    b = summary(1, requests={"queue_receives": 1, "queue_empty_receives": 5, "store_puts": 4})
    r = run_cost([a, b], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0, backend="local")
    assert r["requests"]["queue_receives"] == 2 and r["requests"]["store_puts"] == 4
    # SQS 10 * 0.4e-6 = 4e-6; GET 2 * 4e-7 = 8e-7; PUT 4 * 5e-6 = 2e-5
    assert r["request_usd"] == pytest.approx(0.0000248)
    assert r["requests_basis"] == "as if on SQS + S3"
    assert any("as if on AWS" in n for n in r["notes"])


def test_run_in_progress_is_partial(rates):
    """2 of 3 claims done: the report covers those two and says it is partial."""
    r = run_cost([summary(0), summary(1)], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0,
                 expected_claims=3)
    assert r["partial"]
    assert any("partial: 2 of 3" in n for n in r["notes"])
    assert "[PARTIAL]" in format_run_cost(r, "t.gpu")[0]


def test_run_with_no_finished_claims_has_no_per_item_figures(rates):
    """Nothing finished yet: $0, and per-item figures are None rather than a division by zero."""
    r = run_cost([], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0, expected_claims=2)
    assert r["total_usd"] == 0 and r["usd_per_1000_items"] is None and r["seconds_per_item"] is None
    assert r["partial"]


# ---- crossover ladder ----
# Exact binary numbers so break-evens land on integers: r = $0.5/s, R = $1/s, c = 1 s, E = 8 s, A = 24 s.
#   warm = 0.5 n,  cold = 0.5 * 32 + 0.5 n = 16 + 0.5 n,  serverless = 1 * (n + 8) = 8 + n
#   cold = serverless at n* = (16 - 8) / (1 - 0.5) = 16; serverless cheaper below, cold from 17.

def test_ladder_hand_case_and_exact_boundary():
    """At n = 16 cold and serverless tie ($24 each); below, serverless is cheaper; from 17, cold."""
    lad = crossover_ladder(1.0, 8.0, 24.0, 0.5, 1.0, item_counts=(15, 16, 17))
    rows = {row["items"]: row for row in lad["rows"]}
    assert (rows[15]["cold_usd"], rows[15]["serverless_usd"]) == (23.5, 23.0)
    assert (rows[16]["cold_usd"], rows[16]["serverless_usd"]) == (24.0, 24.0)
    assert (rows[17]["cold_usd"], rows[17]["serverless_usd"]) == (24.5, 25.0)
    pair = next(p for p in lad["pairs"] if (p["a"], p["b"]) == ("cold", "serverless"))
    assert pair["break_even_items"] == 16
    assert (pair["cheaper_below"], pair["cheaper_above"], pair["wins_from"]) == ("serverless", "cold", 17)
    assert "tie at 16" in pair["text"]


def test_ladder_boundary_survives_float_noise():
    """r = 0.001, R = 0.002, c = 0.1, E = 3, A = 90: cold = 0.093 + 0.0001 n, serverless = 0.006 + 0.0002 n,
    n* = 0.087 / 0.0001 = 870, computed as 869.9999999999999; still a tie at 870, cold from 871."""
    lad = crossover_ladder(0.1, 3.0, 90.0, 0.001, 0.002, item_counts=(870,))
    pair = next(p for p in lad["pairs"] if (p["a"], p["b"]) == ("cold", "serverless"))
    assert pair["break_even_items"] == pytest.approx(870) and pair["wins_from"] == 871
    assert lad["rows"][0]["cold_usd"] == pytest.approx(lad["rows"][0]["serverless_usd"], rel=1e-12)


def test_ladder_warm_always_beats_cold_and_cold_never_wins():
    """Warm and cold share $/item; cold pays r(A+E) = $16 more up front, so it never wins: 'never', with why."""
    lad = crossover_ladder(1.0, 8.0, 24.0, 0.5, 1.0)
    assert lad["wins"]["warm"] == {"from": 1, "until": None, "reason": None}
    assert lad["wins"]["cold"]["from"] is None
    assert "same $ per item as warm but $16.00 more up front" in lad["wins"]["cold"]["reason"]
    assert lad["wins"]["serverless"]["from"] is None
    assert "warm costs no more up front" in lad["wins"]["serverless"]["reason"]


def test_ladder_cheap_serverless_wins_above_its_break_even():
    """R = $0.5/s below r = $1/s: warm = n, serverless = 0.5 (n + 8) = 4 + 0.5 n, tie at n = 8;
    warm wins 1..7, serverless from 9 on; at 8 the row says 'warm = serverless'."""
    lad = crossover_ladder(1.0, 8.0, 8.0, 1.0, 0.5, item_counts=(7, 8, 9))
    assert lad["wins"]["warm"] == {"from": 1, "until": 7, "reason": None}
    assert lad["wins"]["serverless"] == {"from": 9, "until": None, "reason": None}
    assert [row["cheapest"] for row in lad["rows"]] == ["warm", "warm = serverless", "serverless"]
    cold_vs_sl = next(p for p in lad["pairs"] if (p["a"], p["b"]) == ("cold", "serverless"))
    assert cold_vs_sl["text"].startswith("serverless cheaper at every n")  # 4 < 16 up front, 0.5 < 1 per item


def test_ladder_without_fixed_costs_is_all_ties():
    """A = E = 0: warm and cold are one line; neither wins alone, and the reason says they tie."""
    lad = crossover_ladder(1.0, 0.0, 0.0, 0.5, 1.0)
    assert lad["rows"][0]["cheapest"] == "warm = cold"
    assert lad["wins"]["warm"]["reason"] == "never: ties with cold at every n"


def test_ladder_request_cost_per_item_moves_the_break_even():
    """q = $0.25/item on the instance side: cold = 16 + 0.75 n vs serverless 8 + n, tie at n = 32."""
    lad = crossover_ladder(1.0, 8.0, 24.0, 0.5, 1.0, request_usd_per_item=0.25)
    pair = next(p for p in lad["pairs"] if (p["a"], p["b"]) == ("cold", "serverless"))
    assert pair["break_even_items"] == 32 and pair["wins_from"] == 33


def test_ladder_columns_are_monotone_in_items():
    """With realistic inputs (g5.xlarge vs A10G, 0.2 s/item, 30 s @enter, 90 s acquisition) every
    column grows with n, and cold - warm stays the constant r(A+E)."""
    r, R = 1.006 / 3600, 0.00036772
    lad = crossover_ladder(0.2, 30.0, 90.0, r, R)
    for col in ("warm_usd", "cold_usd", "serverless_usd"):
        values = [row[col] for row in lad["rows"]]
        assert values == sorted(values) and len(set(values)) == len(values)
    for row in lad["rows"]:
        assert row["cold_usd"] - row["warm_usd"] == pytest.approx(r * 120)


def test_ladder_never_shows_a_fraction_of_an_item():
    """Break-evens are told in whole items: the issue's 3-item run (c = 0.34 ms, E = 0, A = 90 s, priced as
    c7i.xlarge against its CPU container) says serverless wins from the first item, not 'below 0.0005 items';
    a break-even at 16.5 items says 'up to 16 items' and 'from 17'."""
    rates = load_rates(REPO_RATES)
    lad = crossover_ladder(0.0003377, 0.0, 90.0, 0.1785 / 3600, serverless_stand_in(rates, "c7i.xlarge")[0],
                           request_usd_per_item=5.93e-6)
    lad["too_few_claims"] = None
    text = "\n".join(format_ladder(lad, {}))
    assert "serverless  cheapest at every n" in text and "warm        never:" in text
    assert not re.search(r"\d\.\d+ items", text), text
    pair = _pair("warm", (0.0, 1.0), "serverless", (8.25, 0.5))   # warm n vs 8.25 + 0.5 n: 16.5 items
    assert pair["text"] == "warm cheaper up to 16 items, serverless from 17" and pair["wins_from"] == 17
    assert _span_reason("warm", (0.0, 1.0), "serverless", (8.25, 0.5), (-math.inf, 16.5)) == \
        "cheaper than serverless only up to 16 items"


def test_ladder_rejects_bad_inputs():
    """Negative seconds or a zero rate are refused."""
    with pytest.raises(ValueError):
        crossover_ladder(-1.0, 8.0, 24.0, 0.5, 1.0)
    with pytest.raises(ValueError):
        crossover_ladder(1.0, 8.0, 24.0, 0.5, 0.0)


# ---- pool-level truth ----

def test_pool_cost_hand_case(rates):
    """1 worker: alive 1000 s = busy 500 (@enter 100 + drain 400) + idle 500; 10 claims, 1000 items,
    A = 90, E = 100. Pool $1.00 ($1.00 per 1,000 items with idle, $0.40 drain only);
    cold 10 x 190 + 400 = 2300 s = $2.30. Idle budget 10 x 190 - 100 = 1800 s, headroom 1300 s,
    180 s between claims."""
    p = pool_cost([stats()], R_INST, rates, None, 90.0)
    assert (p["drain_seconds"], p["idle_seconds"], p["busy_fraction"]) == (400.0, 500.0, 0.5)
    assert p["usd"] == pytest.approx(1.0)
    assert p["usd_per_1000_items"] == pytest.approx(1.0)
    assert p["drain_usd_per_1000_items"] == pytest.approx(0.4)
    assert p["cold"]["enter_seconds"] == 100.0 and p["inputs"]["@enter seconds"] == "measured"
    assert p["cold"]["usd"] == pytest.approx(2.3)
    assert (p["idle_budget_seconds"], p["idle_headroom_seconds"]) == (1800.0, 1300.0)
    assert p["idle_budget_per_claim_seconds"] == pytest.approx(180.0)
    assert p["warm_beats_cold"]


def test_pool_idling_past_its_budget_loses_to_cold(rates):
    """Alive 3000 s: idle 2500 > budget 1800, so warm ($3.00) loses to cold ($2.30) by exactly 700 s of idle."""
    p = pool_cost([stats(alive=3000.0)], R_INST, rates, None, 90.0)
    assert not p["warm_beats_cold"]
    assert p["idle_headroom_seconds"] == -700.0
    assert p["usd"] - p["cold"]["usd"] == pytest.approx(700 * R_INST)
    assert "COLD would have been cheaper" in "\n".join(format_pool_cost(p, "t.gpu", "m"))


def test_pool_idle_budget_is_shared_by_its_workers(rates):
    """2 workers, 5 claims each: budget 10 x 190 - 2 x 100 = 1700 instance-s = 85 s between claims each."""
    p = pool_cost([stats(claims=5, worker_id="a"), stats(claims=5, worker_id="b")], R_INST, rates, None, 90.0)
    assert p["idle_budget_seconds"] == 1700.0
    assert p["idle_budget_per_claim_seconds"] == pytest.approx(85.0)


def test_pool_cold_starts_can_be_counted_runs(rates):
    """10 claims from 2 runs: cold pays 2 x 190 s, budget 380 - 100 = 280 s."""
    p = pool_cost([stats()], R_INST, rates, 100.0, 90.0, cold_starts=2)
    assert p["idle_budget_seconds"] == 280.0
    assert p["inputs"]["cold starts"] == "given"


def test_pool_since_prorates_an_older_worker(rates):
    """Worker alive 09:00-10:00, --since 09:30: half its counters, none of its @enter (paid at start)."""
    p = pool_cost([stats(alive=3600.0, busy=600.0)], R_INST, rates, None, 90.0, since="2026-11-29T09:30:00Z")
    assert (p["instance_seconds"], p["busy_seconds"], p["claims"], p["enter_seconds"]) == (1800.0, 300.0, 5.0, 0.0)
    assert any("prorated to 50%" in n for n in p["notes"])


def test_pool_since_drops_workers_gone_before_it(rates):
    """A worker last seen before --since is outside the window: an empty report, not an error."""
    p = pool_cost([stats()], R_INST, rates, None, 90.0, since="2026-11-29T11:00:00+00:00")
    assert p["workers"] == 0 and p["usd_per_1000_items"] is None
    assert format_pool_cost(p, "t.gpu", "m") == ["pool cost m: no worker stats in the window"]


def test_pool_bad_since_is_a_user_error(rates):
    """--since that is not ISO-8601 says so."""
    with pytest.raises(UserError, match="ISO-8601"):
        pool_cost([stats()], R_INST, rates, None, 90.0, since="yesterday")


def test_measured_enter_is_the_mean_over_all_enters():
    """(100 + 50) s over 2 @enters = 75 s; no @enter recorded = None."""
    assert measured_enter_seconds([stats(enter=100.0), stats(enter=50.0)]) == 75.0
    assert measured_enter_seconds([]) is None


# ---- bad rates files ----

def _without(keys):
    r = copy.deepcopy(RATES)
    node = r
    for k in keys[:-1]:
        node = node[k]
    del node[keys[-1]]
    return r


def _with(keys, value):
    r = copy.deepcopy(RATES)
    node = r
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return r


@pytest.mark.parametrize("rates_doc, message", [
    (_without(("ec2", "instances", "t.gpu", "usd_per_hour")), r"missing field ec2\.instances\['t\.gpu'\]\.usd_per_hour"),
    (_without(("requests", "sqs_usd_per_million")), r"missing field requests\.sqs_usd_per_million"),
    (_without(("serverless", "cards", "X1", "source")), r"missing field serverless\.cards\.X1\.source"),
    (_with(("ec2", "instances", "t.gpu", "usd_per_hour"), 0), r"usd_per_hour must be a positive number, got 0"),
    (_with(("serverless", "cards", "X1", "usd_per_second"), -0.002), r"usd_per_second must be a positive number"),
    (_with(("requests", "s3_get_usd_per_thousand", "value"), "0.0004"), r"must be a positive number, got '0.0004'"),
    (_with(("ec2", "spot_fraction", "value"), 1.5), r"spot_fraction\.value must be a fraction"),
    (_with(("ec2", "instances", "t.gpu", "serverless_card"), "Z9"), r"'Z9' is not in serverless\.cards"),
    (_with(("defaults", "instance_type", "value"), "g9.huge"), r"defaults\.instance_type 'g9\.huge'"),
    (_with(("version",), 2), r"version 2 is not supported"),
])
def test_bad_rates_file_names_file_and_field(tmp_path, rates_doc, message):
    """Each defect is a UserError that names the file and the field."""
    path = write_rates(tmp_path, rates_doc)
    with pytest.raises(UserError, match=message) as err:
        load_rates(path)
    assert str(path) in str(err.value)


def test_missing_rates_file_says_how_to_fix_it(tmp_path):
    """A missing file is named, with the next step."""
    with pytest.raises(UserError, match=r"nope\.json not found.*HINT"):
        load_rates(tmp_path / "nope.json")


def test_rates_file_that_is_not_json_gives_the_line(tmp_path):
    """Broken JSON names the file and the line of the error."""
    path = tmp_path / "rates.json"
    path.write_text('{"version": 1,\n "updated": }')
    with pytest.raises(UserError, match=r"rates\.json: not valid JSON .* line 2"):
        load_rates(path)


# ---- report lines ----

def test_run_report_lines_label_every_input(rates):
    """The printed run cost labels measured and assumed inputs and shows the saving."""
    r = run_cost([summary()], R_INST, rates, enter_seconds=30.0, acquisition_seconds=90.0)
    text = "\n".join(format_run_cost(r, price_label(rates, "t.gpu")))
    assert "@enter seconds: measured" in text and "acquisition seconds: assumed" in text
    assert "saving    $0.12 (85.7%)" in text  # cold (90 + 30 + 20) s = $0.14, actual $0.02


def test_ladder_lines_show_status_and_never(rates):
    """The printed ladder carries each input's status and the 'never' reasons."""
    lad = crossover_ladder(1.0, 8.0, 24.0, 0.5, 1.0)
    text = "\n".join(format_ladder(lad, {"c": "measured", "E": "measured", "A": "assumed"}))
    assert "c = 1 s/item (measured)" in text and "A = 24 s acquisition (assumed)" in text
    assert "cold        never:" in text
    assert "warm        cheapest at every n" in text


@pytest.mark.parametrize("value, text", [
    (0, "$0"), (1.006, "$1.006"), (0.000305556, "$0.000305556"), (0.1, "$0.10"), (1234.5678, "$1,234.57"),
    (-0.25, "-$0.25"), (0.000000188, "$0.000000188"),
])
def test_dollars_keep_six_significant_figures_when_small(value, text):
    """Small amounts keep 6 significant figures, large ones cents."""
    assert _usd(value) == text


# --- end to end: what the worker counted, and what the CLI prints -----------------------------

import json as _json

from conftest import HANDLERS, cli, write_items
import calque_core
import calque_cost


@pytest.fixture(params=["local", "aws"])
def any_env(request, local_env, tmp_path):
    if request.param == "local":
        return local_env
    return request.getfixturevalue("aws_env")


def test_workers_count_requests_on_both_backends(any_env, tmp_path):
    """Each summary records the requests since the worker's previous claim: a later claim's are exactly the
    summary check and manifest read, one receive, the results and summary writes, and the ack (no stats write
    between two claims: stats go on a timer); the first claim also carries the worker's start-up reads."""
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(6)])
    out = cli(any_env, "submit", "--model", "m", "--handler", f"{HANDLERS}:Echo", items, "--claim-size", "3", "--json")
    assert out.returncode == 0, out.stderr
    first, second = sorted(_json.loads(out.stdout)["summaries"], key=lambda s: s["started_at"])
    assert first["worker_id"] == second["worker_id"]          # one shard: one worker served both
    assert {k: v for k, v in second["requests"].items() if v} == {
        "queue_receives": 1, "queue_other": 1, "store_gets": 2, "store_puts": 2}
    assert first["requests"]["queue_receives"] == 1 and first["requests"]["store_puts"] >= 3   # + the start stats
    assert first["requests"]["store_gets"] > 2                 # + pool record, handler snapshot
    rates = load_rates(REPO_RATES)
    # SQS: 2 requests x $0.40/M; S3: 2 GETs x $0.0004/k + 2 PUTs x $0.005/k
    assert request_cost(rates, second["requests"]) == pytest.approx(2 * 0.40e-6 + 2 * 0.0004e-3 + 2 * 0.005e-3)


def test_printed_cost_equals_recomputation_from_summaries(local_env, tmp_path):
    """`calque.py cost RUN --json` is the arithmetic of this module over the run's own summaries."""
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(10)])
    out = cli(local_env, "submit", "--model", "m", "--handler", f"{HANDLERS}:Echo", items, "--claim-size", "4", "--json")
    assert out.returncode == 0, out.stderr
    run = _json.loads(out.stdout)
    summaries = run["summaries"]
    out = cli(local_env, "cost", run["run"]["run_id"], "--instance-type", "g6.xlarge", "--json")
    assert out.returncode == 0, out.stderr
    printed = _json.loads(out.stdout)[0]["cost"]
    rates = load_rates(REPO_RATES)
    rate = instance_rate_per_second(rates, "g6.xlarge")
    by_hand = sum(claim_cost(s, rate, rates)["total_usd"] for s in summaries)
    assert printed["total_usd"] == pytest.approx(by_hand, rel=1e-12)
    assert printed["items"] == 10 and printed["claims"] == 3 and not printed["partial"]
    paid = [s for s in summaries if s["enter_seconds_paid"] > 0]
    assert printed["cold"]["enter_seconds"] == pytest.approx(sum(s["enter_seconds_paid"] for s in paid) / len(paid))
    text = cli(local_env, "cost", run["run"]["run_id"], "--instance-type", "g6.xlarge")
    assert text.returncode == 0 and "ladder" in text.stdout and "cheapest" in text.stdout


def test_cost_cli_errors_and_pool_cost(local_env, tmp_path):
    """Unknown run, unknown instance type and a bad rates file are one-line errors; pool cost reports a live pool,
    priced as a CPU instance where its workers saw no GPU."""
    import calque
    from conftest import backend_for
    out = cli(local_env, "cost", "20990101-000000-abcdef")
    assert out.returncode == 2 and "no run" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1").returncode == 0
    items = write_items(tmp_path / "items.jsonl", [{"x": 1}])
    out = cli(local_env, "submit", "--pool", "m", items)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.split()[1]
    out = cli(local_env, "cost", run_id, "--instance-type", "x9.huge")
    assert out.returncode == 2 and "known: c7i.xlarge, g4dn.12xlarge" in out.stderr
    bad = tmp_path / "rates.json"
    bad.write_text("{")
    out = cli(local_env, "cost", run_id, "--rates", str(bad))
    assert out.returncode == 2 and str(bad) in out.stderr and "Traceback" not in out.stderr
    out = cli(local_env, "pool", "cost", "--model", "m", "--json")
    assert out.returncode == 0, out.stderr
    report = _json.loads(out.stdout)["cost"]
    assert report["workers"] == 1 and report["claims"] == 1 and report["instance_seconds"] > 0
    backend = backend_for(local_env)
    stats = calque_core.read_worker_stats(backend, "m")
    priced_as_cpu = _json.loads(out.stdout)["priced_as"].startswith("c7i.xlarge")
    assert priced_as_cpu == all(w["no_gpu"] for w in stats), "a pool that saw no GPU is priced as CPU"
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0


def test_cost_of_a_run_in_progress_is_partial(local_env, tmp_path):
    """A run with claims still pending is priced as far as it has gone, and marked partial."""
    import calque
    from conftest import backend_for
    assert cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo",
               "--workers", "0").returncode == 0
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(4)])
    run_id = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "2", "--no-wait").stdout.strip()
    backend = backend_for(local_env)
    queue = backend.queues.open_queue("calque-pool-m")
    import warmd
    record = calque_core.load_pool(backend, "m")
    worker = warmd.Worker(backend, record, calque_core.worker_stats_prefix("m"), calque_core.settings(), False)
    worker.start()
    worker.handle(queue.receive(1))       # one of the two claims
    out = cli(local_env, "cost", run_id, "--json")
    assert out.returncode == 0, out.stderr
    assert _json.loads(out.stdout)[0]["cost"]["partial"] is True
    assert "[PARTIAL]" in cli(local_env, "cost", run_id).stdout


def test_a_run_without_a_gpu_is_priced_as_a_cpu_instance(tmp_path):
    """Priced by default, a run whose workers saw no GPU is priced as rates.json's CPU instance, and its first
    cost line says so; a type the user names, or a run that saw a GPU, keeps its price. A rates file without a
    CPU instance says in the label that a GPU price was assumed."""
    import calque
    no_gpu = dict(summary(), gpu_utilisation={"measured": False, "reason": "no GPU visible to NVML (NVMLError)"})
    gpu = dict(summary(), gpu_utilisation={"measured": True, "value": 0.5})
    price = calque_cost.pricing()
    cpu = calque_cost.choose_pricing(price, [no_gpu, no_gpu])
    assert cpu.instance_type == "c7i.xlarge" and cpu.rate_per_s * 3600 == pytest.approx(0.1785)
    assert cpu.label.startswith("c7i.xlarge (4 vCPU, no GPU) on-demand $0.1785/h") and "saw a GPU" in cpu.label
    assert calque_cost.choose_pricing(price, [no_gpu, gpu]) == price and calque_cost.choose_pricing(price, []) == price
    cancelled = dict(summary(items=0), status="cancelled", worker_id="submitter")   # run by no worker: says nothing
    assert calque_cost.choose_pricing(price, [no_gpu, cancelled]) == cpu and calque_cost.choose_pricing(price, [cancelled]) == price
    assert calque_cost.choose_pricing(calque_cost.pricing(instance_type="g5.xlarge"), [no_gpu]).instance_type == "g5.xlarge"
    assert calque_cost.choose_pricing(calque_cost.pricing(spot=True), [no_gpu]).rate_per_s == pytest.approx(0.1785 * 0.35 / 3600)
    assert calque_cost.serverless_stand_in(price.rates, "c7i.xlarge")[0] == pytest.approx(2 * 1.31e-05 + 8 * 2.22e-06)
    bare = calque_cost.pricing(rates_file=write_rates(tmp_path, RATES))
    assert calque_cost.choose_pricing(bare, [no_gpu]).label.endswith("a GPU price assumed for work that used no GPU (the rates "
                                                        "file names no defaults.cpu_instance_type)")
    lines = format_run_cost(run_cost([no_gpu], cpu.rate_per_s, price.rates, 0.0, 0.0), cpu.label)
    assert lines[0].startswith("cost      priced as c7i.xlarge (4 vCPU, no GPU)")
    on_g6 = dict(gpu, instance_type="g6.xlarge")         # an EC2 worker names the type it ran on
    ran_on = calque_cost.choose_pricing(price, [on_g6, on_g6, cancelled])
    assert ran_on.instance_type == "g6.xlarge" and ran_on.label.endswith("the type the workers ran on "
                                                                         "(--instance-type prices another)")
    assert calque_cost.choose_pricing(price, [on_g6, dict(gpu, instance_type="g5.xlarge")]) == price   # two types: default
    assert calque_cost.choose_pricing(price, [dict(gpu, instance_type="x9.nano")]) == price           # not in the rates
    assert calque_cost.choose_pricing(calque_cost.pricing(instance_type="g5.xlarge"), [on_g6]).instance_type == "g5.xlarge"


def test_workers_that_name_their_instance_type_are_priced_as_it(local_env, tmp_path):
    """A worker started with CALQUE_INSTANCE_TYPE (an EC2 bootstrap sets it) names it in its summaries and
    stats, and `cost` and `pool cost` price its work as that type, in both spellings."""
    import subprocess
    from conftest import PY
    env = dict(local_env, CALQUE_INSTANCE_TYPE="g6.xlarge")
    assert cli(env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1",
               cwd=tmp_path).returncode == 0
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(4)])
    assert cli(local_env, "submit", "--pool", "m", items, cwd=tmp_path).returncode == 0
    cost = _json.loads(cli(local_env, "cost", "latest", "--json", cwd=tmp_path).stdout)[0]
    assert cost["priced_as"].startswith("g6.xlarge") and "the type the workers ran on" in cost["priced_as"]
    installed = subprocess.run([os.path.join(os.path.dirname(PY), "calque"), "pool", "cost", "--model", "m"],
                               env=local_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0 and "g6.xlarge" in installed.stdout and "the type the workers ran on" in installed.stdout


def test_money_noise_prints_as_zero():
    """A difference below a millionth of a cent is $0: a cold run's saving against itself is 0, not 5e-20."""
    assert _usd(5.42101e-20) == "$0" and _usd(-3e-9) == "$0" and _usd(2e-8) == "$0.00000002"
    claims = [summary(claim=0, enter=0.15, acquisition=20.0, claim_seconds=15.95,
                      requests={"store_gets": 7, "queue_receives": 1}),
              summary(claim=1, claim_seconds=18.82, requests={"store_gets": 5, "queue_receives": 1}),
              summary(claim=2, claim_seconds=10.77, requests={"store_gets": 3, "queue_receives": 1})]
    report = run_cost(claims, 0.1785 / 3600, RATES, 0.15, 20.0)   # a cold run: summed two ways, 4e-19 apart
    assert report["cold"]["usd"] != report["total_usd"]
    assert report["saving_usd"] == 0.0 and report["saving_fraction"] == 0.0


def _dollars(text):
    return float(text.replace("$", "").replace(",", ""))


def test_every_verb_prices_a_pool_alike(local_env, tmp_path):
    """plan, submit, cost, pool cost, the dashboard and runs report price one pool with one chooser: the same
    instance, label and serverless stand-in (here workers see no GPU: c7i.xlarge and its CPU container), and
    --instance-type moves them all; `cost RUN`'s fixed seconds and cold block add up on their lines; both
    spellings (python calque.py, the installed calque)."""
    import html
    import subprocess
    import calque
    import calque_dashboard
    from conftest import PY, backend_for
    installed = lambda *args: subprocess.run([os.path.join(os.path.dirname(PY), "calque"), *args], env=local_env,
                                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert cli(local_env, "pool", "create", "--model", "m", "--handler", f"{HANDLERS}:Echo", "--workers", "1",
               cwd=tmp_path).returncode == 0
    items = write_items(tmp_path / "items.jsonl", [{"x": i} for i in range(12)])
    submitted = cli(local_env, "submit", "--pool", "m", items, "--claim-size", "4", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.split()[1]
    backend = backend_for(local_env)
    no_gpu = all(w["no_gpu"] for w in calque_core.read_worker_stats(backend, "m"))
    itype, container = ("c7i.xlarge", "2 cores + 8 GiB") if no_gpu else ("g5.xlarge", "1x A10G")
    plan = _json.loads(cli(local_env, "plan", "--pool", "m", items, "--json", cwd=tmp_path).stdout)
    cost = _json.loads(cli(local_env, "cost", run_id, "--json", cwd=tmp_path).stdout)[0]
    pool = _json.loads(cli(local_env, "pool", "cost", "--model", "m", "--json", cwd=tmp_path).stdout)
    label = cost["priced_as"]
    assert label.startswith(itype) and ("no worker saw a GPU" in label) == no_gpu
    assert plan["priced_as"] == pool["priced_as"] == label and plan["instance_type"] == itype
    assert f"priced as {label}" in submitted.stdout
    assert plan["serverless"]["container"] == container
    assert cost["ladder"]["inputs"]["serverless_rate"] == pytest.approx(
        calque_cost.serverless_stand_in(calque_cost.load_rates(), itype)[0])
    board = calque_dashboard.Dashboard({"CALQUE_STATE": local_env["CALQUE_STATE"]}, backend, calque_cost.pricing())
    assert board.pool_view("m")["priced_as"] == board.run_view(run_id)["cost"]["priced_as"] == label
    report = tmp_path / "report.html"
    assert installed("runs", "report", run_id, "--html", str(report)).returncode == 0
    assert html.escape(label) in report.read_text()

    text = installed("plan", "--pool", "m", items)          # the installed spelling prints what --json says
    assert text.returncode == 0 and f"priced as {label}" in text.stdout and f"({container} per container" in text.stdout
    text = installed("cost", run_id).stdout
    assert f"(published, {container})" in text and "cheapest" in text and not re.search(r"\d\.\d+ items", text)
    acq, enter, fixed = map(float, re.search(r"fixed +([\d.]+) s acquisition \+ ([\d.]+) s @enter paid = ([\d.]+) s",
                                             text).groups())
    assert abs(acq + enter - fixed) <= 0.01
    cold_usd = _dollars(re.search(r"cold +(\$[\d.,]+) as a fresh acquisition", text)[1])
    shards, acq, enter, fixed, fixed_usd = re.search(
        r"  fixed +(\d+) x \(([\d.]+) s acquisition \+ ([\d.]+) s @enter\) = ([\d.]+) s +(\$[\d.,]+)", text).groups()
    assert abs(int(shards) * (float(acq) + float(enter)) - float(fixed)) <= 0.01
    variable_usd = _dollars(re.search(r"variable .* s \(drain\) +(\$[\d.,]+)", text)[1])
    request_usd = _dollars(re.search(r"requests .* (\$[\d.,]+) \(as if", text)[1])
    assert _dollars(fixed_usd) + variable_usd + request_usd == pytest.approx(cold_usd, rel=1e-4)

    few = cli(local_env, "submit", "--pool", "m", write_items(tmp_path / "few.jsonl", [{"x": 1}] * 3), cwd=tmp_path)
    text = cli(local_env, "cost", few.stdout.split()[1], cwd=tmp_path).stdout
    assert "not enough claims to extrapolate: 1 finished, the ladder needs 3" in text and "cheapest" not in text
    page = calque_dashboard.run_body(board.run_view(few.stdout.split()[1]))
    assert "not enough claims to extrapolate" in page and 'id="ladder"' not in page

    named = _json.loads(cli(local_env, "plan", "--pool", "m", items, "--instance-type", "g5.xlarge", "--json",
                            cwd=tmp_path).stdout)
    cost = _json.loads(installed("cost", run_id, "--instance-type", "g5.xlarge", "--json").stdout)[0]
    assert named["priced_as"] == cost["priced_as"] and cost["priced_as"].startswith("g5.xlarge (1x A10G)")
    assert named["serverless"]["container"] == "1x A10G"
    assert cli(local_env, "pool", "delete", "--model", "m", "--yes").returncode == 0
