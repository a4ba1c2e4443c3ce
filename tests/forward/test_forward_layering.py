"""The shared forward path sits below the trainer: evaluation and `maximus.forward` load without
importing anything from `maximus.train` (the old evaluate <-> objective cycle is gone)."""
import subprocess
import sys


def test_forward_and_evaluate_do_not_import_train():
    code = ("import sys, maximus.forward, maximus.evaluate; "
            "print(sorted(m for m in sys.modules if m.startswith('maximus.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
