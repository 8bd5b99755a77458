"""The controller and the simulator are engine-free, torch-free and Ray-free."""
import subprocess
import sys


def test_control_and_sim_import_without_engine_torch_or_ray():
    code = ("import sys, adaptspec.control, adaptspec.sim.runner, adaptspec.sim.report, adaptspec.sim.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ray') "
            "or m.startswith(('adaptspec.engine', 'adaptspec.models'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
