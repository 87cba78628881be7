"""The kit's floors (calque.py's docstring draws them): each module imports only kit modules below it,
wherever the import stands (a lazy import inside a function is an edge too), so there is no import
circle; and EC2 is reached from two places: calque_fleet, which chooses a pool's fleet for every
verb, and warmd.py on an EC2 instance, for its own instance (spot notices, scale-in protection)."""
import ast
import os

from conftest import ROOT

FLOORS = {   # a module may import kit modules of a lower floor only
    "calque_values": 0,
    "calque_core": 1,
    "calque_sources": 2, "calque_cost": 2,
    "calque_runs": 3,
    "calque_supervisor": 4, "calque_ec2": 4,
    "calque_fleet": 5, "warmd": 5,
    "calque_dashboard": 6,
    "calque": 7,
}


def kit_imports(module):
    """(line, imported kit module) for every import statement of `module`, at any depth."""
    with open(os.path.join(ROOT, module + ".py")) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for name in names:
            if name.split(".")[0] in FLOORS:
                yield node.lineno, name.split(".")[0]


def test_every_kit_module_stands_on_a_floor():
    """A new top-level module of the kit gets its floor here, and so its place in the drawing."""
    kit = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py") and name != "setup.py"}
    assert kit == set(FLOORS)


def test_each_module_imports_only_those_below_it():
    upward = [f"{m}.py:{line} imports {other}" for m in FLOORS for line, other in kit_imports(m)
              if FLOORS[other] >= FLOORS[m] and other != m]
    assert upward == []


def test_ec2_is_reached_from_the_fleet_chooser_and_the_worker_only():
    reach = sorted({m for m in FLOORS for _, other in kit_imports(m) if other == "calque_ec2"})
    assert reach == ["calque_fleet", "warmd"]
