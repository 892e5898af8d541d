"""bench/step.py: without TRL the section says how to install it and skips, before it runs
anything; its rows compute the ratios from the two sides' measurements."""
import sys

from bench import step


def test_step_section_skips_cleanly_without_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    ran = []
    monkeypatch.setattr(step, "zeros_side", lambda *a: ran.append(a))
    table = step.run(True, "python -m bench step --quick")
    assert not ran and "pip install trl" in table[-1] and "skipped" in table[-1]


def test_step_rows_are_ratios_of_the_medians():
    # zeros: 1 s per step at 32 tokens per row; TRL: 4 s at 16; the first step is a warm-up
    rows = step.step_rows([9.0, 1.0, 1.0], [{"len_mean": 32.0}] * 3, [9.0, 4.0, 4.0],
                          [16.0, 16.0, 16.0], 1, "1.16.0", "cmd")
    cells = [r.split(" | ") for r in rows]
    assert cells[0][1:4] == ["1.00", "4.00", "0.25x"]  # seconds per step
    assert cells[1][3] == "0.12x"  # per generated token: 1/(32*128) against 4/(16*128)
    assert cells[2][1:4] == ["32.0", "16.0", "2.00x"]  # mean completion length
