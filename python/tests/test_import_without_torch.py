"""`import distca` works without PyTorch (the planner package needs only NumPy); `import
distca.torch` then fails with a message that says what to install."""
import subprocess
import sys

PROGRAM = '''
import sys
sys.modules["torch"] = None          # as if PyTorch were not installed
import distca
plan = distca.plan([[512, 64], [128] * 4], model="llama-8b")
print("plan", len(plan.tasks))
try:
    import distca.torch
except ImportError as e:
    print("torch:", e)
'''


def test_distca_imports_without_torch_and_distca_torch_says_what_is_missing():
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("plan ") and int(lines[0].split()[1]) > 0
    assert lines[1] == "torch: distca.torch needs PyTorch >= 2.10 (scripts/install-python.sh installs it into .venv)"
