"""The fleet contract (calque_fleet.fleet_for): the same checks on each fleet, this machine's
(LocalFleet, on a local store) and EC2's (Ec2Fleet, on moto as test_ec2): it has what the
interface names; `pool create` in its unit, then `pool scale` spelled in the other unit (two
spellings of one count), are what its bounds, status and list say; `pool delete` leaves none.
A third fleet adds its case to FLEETS. Then the count flags' refusals, as a user types them."""
import json
import os
import subprocess

import pytest

import calque
import calque_core
import calque_ec2
import calque_fleet
import calque_supervisor
from conftest import PY, ROOT
from test_commands import BIN, SPELLINGS
from test_ec2 import MODEL, STORE, aws  # noqa: F401 (aws: a fixture)

HANDLER = os.path.join(ROOT, "tests", "handlers.py") + ":Echo"
MEMBERS = ("unit", "here", "dry_run", "create", "scale", "bounds", "boost", "waking", "status",
           "lines", "logs", "delete", "pools", "cold_workers", "start_seconds", "grant_read")
FLEETS = {   # its class, unit, `pool create` and `pool scale` flags
    "local": (calque_supervisor.LocalFleet, "workers", ["--min-workers", "0", "--max-workers", "2"],
              ["--max-instances", "3", "--no-wait"]),
    "ec2": (calque_ec2.Ec2Fleet, "instances", ["--min-instances", "0", "--max-instances", "2",
                                               "--instance-type", "g5.xlarge", "--yes-spend-money"],
            ["--max-workers", "3", "--yes-spend-money"]),
}


@pytest.fixture(params=FLEETS)
def fleet_env(request, monkeypatch, tmp_path):
    """A fresh store for the fleet: a local folder, or an s3:// bucket on moto (test_ec2's aws)."""
    monkeypatch.setenv("CALQUE_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("CALQUE_ENV", str(tmp_path / "none.env"))
    if request.param == "ec2":
        request.getfixturevalue("aws")
        monkeypatch.setenv("CALQUE_STORE", STORE)
    else:
        monkeypatch.setenv("CALQUE_STORE", str(tmp_path / "store"))
    return request.param


def test_each_fleet_keeps_the_contract(fleet_env, capsys):
    cls, unit, create, scale = FLEETS[fleet_env]
    assert calque.main(["pool", "create", "--model", MODEL, "--handler", HANDLER, *create]) == 0
    conf = calque_core.settings()
    backend = calque_core.open_backend(conf["CALQUE_STORE"])
    record = calque_core.load_pool(backend, MODEL)
    fleet = calque_fleet.fleet_for(conf, backend, record)
    assert type(fleet) is cls and fleet.unit == unit and fleet.bounds(record) == (0, 2)
    documented = calque_fleet.fleet_for.__doc__
    assert [name for name in MEMBERS if name not in documented or not hasattr(fleet, name)] == []
    assert calque_fleet.pool_ceiling(conf, backend, record)[:3] == (0, 2, unit)   # the planner's
    assert fleet.start_seconds(1.0, 2.0) > 3.0   # @enter and acquisition, then what it adds

    assert calque.main(["pool", "scale", "--model", MODEL, *scale]) == 0
    record = calque_core.load_pool(backend, MODEL)
    assert fleet.bounds(record) == (0, 3)
    status = calque_fleet.pool_status(conf, backend, MODEL)
    assert (status["queue"]["visible"], status["queue"]["in_flight"], status["dlq"]["visible"]) == (0, 0, 0)
    assert status["workers"] == [] and (status["ec2"] is None) == fleet.here
    lines = calque_fleet.format_pool_status(status, backend.describe())
    assert lines[-1] == "  workers with stats: 0 (0 running, 0 lost)", lines
    assert (fleet.lines(status) == []) == fleet.here
    assert MODEL in [p["model"] for p in fleet.pools()]

    capsys.readouterr()
    assert calque.main(["pool", "delete", "--model", MODEL, "--yes"]) == 0
    assert MODEL not in [p["model"] for p in fleet.pools() if p["record"]]
    with pytest.raises(calque.UserError, match="no pool for model"):
        calque_core.load_pool(backend, MODEL)
    assert calque_supervisor.read_supervisor(conf, MODEL) is None


def test_fleet_for_chooses_in_one_place(tmp_path, monkeypatch):
    """A record's "ec2" entry, --instances (any of its spellings) on a new pool, or EC2's own flags
    on an s3:// store for a cold run: EC2; anything else: this machine."""
    local = calque_core.open_backend(str(tmp_path / "store"))

    class S3:   # what fleet_for reads of an s3:// backend
        kind = "aws"

    def fleet(backend, record=None, **flags):
        args = calque.build_parser().parse_args(flags.pop("argv")) if "argv" in flags else None
        return type(calque_fleet.fleet_for({}, backend, record, args)).__name__
    assert fleet(local, {"model": "m", "queue": "q"}) == "LocalFleet"
    assert fleet(S3, {"model": "m", "queue": "q", "ec2": {"instances": 1}}) == "Ec2Fleet"
    assert fleet(S3, {"model": "m"}) == "Ec2Fleet"          # no record left on S3: found by tag
    create = ["pool", "create", "--model", "m", "--handler", "h.py:C"]
    assert fleet(local, argv=create + ["--max-instances", "2"]) == "Ec2Fleet"
    assert fleet(S3, argv=create + ["--workers", "2", "--yes-spend-money"]) == "LocalFleet"
    with pytest.raises(calque_core.UserError, match="--dry-run prints an EC2 pool's AWS calls"):
        fleet(S3, argv=create + ["--dry-run"])   # this machine's fleet, which says it is EC2's flag
    cold = ["submit", "--model", "m", "items.jsonl"]
    assert fleet(S3, argv=cold + ["--ami", "ami-1"]) == "Ec2Fleet"
    assert fleet(local, argv=cold + ["--ami", "ami-1"]) == "LocalFleet"
    assert fleet(S3, argv=cold) == "LocalFleet"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_count_flags_refused_in_one_line(local_env, tmp_path, spelling):
    """Mixed units, one count in both spellings, a negative count, a count with a floor on pool
    scale, a count that is no number: one line naming it, exit 2, nothing created, as `calque`
    and `python calque.py`."""
    command = [os.path.join(BIN, "calque")] if spelling == "installed" else [PY, os.path.join(ROOT, "calque.py")]

    def error(*args):
        out = subprocess.run(command + list(args), env=local_env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr
    create = ["pool", "create", "--model", "m", "--handler", HANDLER]
    assert "--workers 1 --max-instances 2: a pool's workers run in one fleet" in error(
        *create, "--workers", "1", "--max-instances", "2")
    assert "--min-instances -1: must be 0 or more" in error(*create, "--min-instances", "-1")
    assert "--workers and --instances are one count given twice" in error(   # not the last one silently
        *create, "--workers", "1", "--instances", "2")
    assert "argument --instances: invalid int value: 'two'" in error(*create, "--instances", "two")
    assert not os.path.exists(local_env["CALQUE_STORE"]) or not os.listdir(
        os.path.join(local_env["CALQUE_STORE"], "pools"))
    assert subprocess.run(command + create + ["--workers", "0"], env=local_env, cwd=tmp_path,
                          capture_output=True, timeout=60).returncode == 0
    assert "pool scale --instances 1 --min-instances 0: give --workers N" in error(
        "pool", "scale", "--model", "m", "--instances", "1", "--min-instances", "0")
    for verb in (["delete", "--yes"], ["scale", "--workers", "2"]):   # a dry run of this machine's fleet
        assert "--dry-run prints an EC2 pool's AWS calls" in error("pool", *verb, "--model", "m", "--dry-run")
    status = subprocess.run(command + ["pool", "status", "--model", "m", "--json"], env=local_env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["model"] == "m"   # still there
